"""Plot ``benchmarks/results/engine/families.json``: each family's offline throughput and batch-1
decode on the H200, the rows of one call side by side.

    python -m tidegate.benchmarks.engine.plot_families benchmarks/results/engine/families.json \
        --out benchmarks/results/engine/families.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=Path("families.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = json.loads(args.results.read_text())
    # The dense families from call 1, the MoE models (tuned kernel) from call 3.
    rows = [(call, model) for call, models in (("call1", ("llama-3-8b", "qwen2.5-7b",
                                                          "mistral-7b")),
                                               ("call3", ("mixtral-8x7b", "qwen3-30b-a3b")))
            for model in models]
    names = [f"{m}\n({c})" for c, m in rows]
    offline = [calls[c][f"random:{m}"]["offline"]["output_tok_s"] for c, m in rows]
    batch1 = [calls[c][f"random:{m}"]["batch1"]["decode_tok_s"] for c, m in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, values, title in ((axes[0], offline, "offline 1000 x 256/256: output tok/s"),
                              (axes[1], batch1, "batch-1 decode: tok/s")):
        bars = ax.bar(range(len(values)), values, color=["#4c72b0"] * 3 + ["#dd8452"] * 2)
        ax.set_xticks(range(len(values)), names, fontsize=8)
        ax.set_title(title)
        for bar, value in zip(bars, values, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,.0f}", ha="center",
                    va="bottom", fontsize=8)
    fig.suptitle("tidegate on one H200, bf16, random weights of each model's real shape")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
