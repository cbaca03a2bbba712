"""Plot ``benchmarks/serving/prefix_routing.py`` runs: per run, the time to first token of every job
(its distribution, routing off against on) with the prefix-cache hit rates in the legend.

    python -m tidegate.benchmarks.serving.plot_prefix_routing benchmarks/results/serving/prefix_routing_smollm2.json \\
        benchmarks/results/serving/prefix_routing_smollm2_small_cache.json \\
        --out benchmarks/results/serving/prefix_routing.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=Path("prefix_routing.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.results), figsize=(6 * len(args.results), 4.2),
                             squeeze=False)
    for ax, path in zip(axes[0], args.results, strict=True):
        run = json.loads(path.read_text())
        a = run["args"]
        cache = f"{a['kv_cache_gb']} GiB KV cache" if a["kv_cache_gb"] else "default KV cache"
        for mode, style in (("off", "--"), ("on", "-")):
            m = run["modes"][mode]
            ttft = [t / 1000 for t in m["ttft_ms_sorted"]]
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], style,
                    label=f"routing {mode}: hit rate {m['hit_rate']:.2f}, "
                          f"p50 {m['ttft_ms']['p50'] / 1000:.2f} s")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("fraction of jobs")
        ax.set_title(f"{a['model']}, {a['workers']} workers, {cache}\n"
                     f"{a['prompts']} system prompts of {a['prefix_tokens']} tokens, "
                     f"{a['jobs']} jobs, {a['concurrency']} clients", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
