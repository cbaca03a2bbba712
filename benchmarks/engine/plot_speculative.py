"""Plot the break-even run of ``benchmarks/engine/speculative_gpu.py``: by batch size, a verify
step's cost against a decode step's (speculation with a free draft pays while it is below
1 + a K, the tokens a verify step gives at acceptance a), and with drafts that are never kept,
the governor's and forced speculation's tok/s against plain decoding.

    python -m tidegate.benchmarks.engine.plot_speculative benchmarks/results/engine/speculative_h200.json \\
        --out benchmarks/results/engine/speculative_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=Path("speculative.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads(args.results.read_text())
    k = run["args"]["k"]
    costs, governed = run["breakeven"]["step_costs"], run["breakeven"]["governor"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    batches = [c["batch"] for c in costs]
    left.plot(batches, [c["ratio"] for c in costs], marker="o", color="black",
              label=f"verify step (K = {k}) / decode step")
    for a, style in ((1.0, "-"), (0.8, "--"), (0.6, ":")):
        left.axhline(1 + a * k, ls=style, color="tab:green",
                     label=f"1 + {a:g} K: pays below, acceptance {a:g}")
    left.set(xscale="log", xlabel="batch (requests at once)", ylabel="step time ratio",
             title=f"{run['model']}, {run['device']}")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend(fontsize=8)
    batches = [g["batch"] for g in governed]
    for key, label in (("governed_vs_plain", "governor's choice"),
                       ("forced_vs_plain", "speculating every step")):
        right.plot(batches, [g[key] for g in governed], marker="o", label=label)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", ylim=(0, 1.2), xlabel="batch (requests at once)",
              ylabel="tok/s / plain tok/s", title="drafts never kept: switched off by itself")
    right.set_xticks(batches, [str(b) for b in batches])
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
