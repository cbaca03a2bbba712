"""Plot the break-even run of ``benchmarks/speculative_gpu.py``: output tok/s by batch size,
plain decoding against forced speculation and the governor's choice (drafts that always agree
and cost nothing), and the speed-ups.

    python benchmarks/plot_speculative.py benchmarks/results/speculative_h200.json \\
        --out benchmarks/results/speculative_h200.png
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
    rows = run["breakeven"]
    batches = [r["batch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for key, label in (("plain_tok_s", "plain"), ("forced_tok_s", "speculating every step"),
                       ("governed_tok_s", "governor's choice")):
        left.plot(batches, [r[key] for r in rows], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="batch (requests at once)",
             ylabel="output tok/s", title=f"{run['model']}, K = {run['args']['k']}, "
                                          f"{run['device']}")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend()
    for key, label in (("forced_speedup", "speculating every step"),
                       ("governed_speedup", "governor's choice")):
        right.plot(batches, [r[key] for r in rows], marker="o", label=label)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="batch (requests at once)", ylabel="x plain",
              title="speed-up over plain decoding")
    right.set_xticks(batches, [str(b) for b in batches])
    right.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
