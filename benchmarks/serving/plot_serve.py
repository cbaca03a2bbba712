"""Latency against request rate from several serve.py result files, on one figure.

    python -m tidegate.benchmarks.serving.plot_serve benchmarks/results/serving/serve_h200.png \
        "before (call 2):benchmarks/results/serving/serve_h200_call2.json" \
        "sweep, 600 jobs:benchmarks/results/serving/serve_h200_sweep.json" \
        "final, 1600 jobs:benchmarks/results/serving/serve_h200_poisson.json"

Each series is ``label:path``; its Poisson runs give TTFT and TPOT p50/p99 and the output
tokens/s against the rate. Where a run carries the engine alone on the same arrivals
(``--engine-alone-rates``), its TPOT p99 is drawn beside the stack's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rated(path: str) -> list[dict]:
    runs = json.loads(Path(path).read_text())["runs"]
    return sorted((r for r in runs if r.get("request_rate")), key=lambda r: r["request_rate"])


def main(out: str, *series: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for i, spec in enumerate(series):
        label, path = spec.rsplit(":", 1)
        runs = rated(path)
        rates = [r["request_rate"] for r in runs]
        color = f"C{i}"
        for ax, key in ((axes[0], "ttft_ms"), (axes[1], "tpot_ms")):
            ax.plot(rates, [r[key]["p50"] for r in runs], "o-", color=color,
                    label=f"{label} p50")
            ax.plot(rates, [r[key]["p99"] for r in runs], "s--", color=color,
                    label=f"{label} p99")
        alone = [(r["request_rate"], r["engine_alone"]["tpot_ms"]["p99"]) for r in runs
                 if r.get("engine_alone")]
        if alone:
            axes[1].plot(*zip(*alone, strict=True), "x", color=color, markersize=10,
                         label=f"{label}: engine alone p99")
        axes[2].plot(rates, [r["output_tok_s"] for r in runs], "o-", color=color,
                     label=f"{label} (whole run)")
        steady = [(r["request_rate"], r["steady_delivered_share"] * r["offered_output_tok_s"])
                  for r in runs if r.get("steady_delivered_share")]
        if steady:
            axes[2].plot(*zip(*steady, strict=True), "D", color=color,
                         label=f"{label} (pipeline full)")
    top = max(r["request_rate"] for s in series for r in rated(s.rsplit(":", 1)[1]))
    axes[2].plot([0, top], [0, top * 256], "k:", label="offered (256 out/job)")
    axes[0].axhline(500, color="grey", lw=0.8)
    axes[1].axhline(40, color="grey", lw=0.8)
    for ax, title in zip(axes, ("TTFT (ms), target p99 500 at 40/s", "TPOT (ms), target p99 40",
                                "output tokens/s"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle("tidegate through the whole stack on one H200: random Llama-3-8B, bf16, "
                 "256 in / 256 out, Poisson arrivals")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the figure to write (PNG)")
    ap.add_argument("series", nargs="+", help="label:path of a serve.py result")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    main(args.out, *args.series)
