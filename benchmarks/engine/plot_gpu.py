"""Plots ``benchmarks/results/engine/gpu.png`` from the recorded H200 runs (``gpu.json``, ``gemv.json``).

Three panels, each version as the run that measured it: batch-1 decode tok/s against the 85%-MBU
target, offline 1000 x 256/256 output tok/s against its target, and one decode step's
projections (32 layers + LM head in one CUDA graph) as cuBLAS and as the fused kernels, against
the read-bandwidth floor.

    python -m tidegate.benchmarks.engine.plot_gpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"

# (label, call key in gpu.json); the labels name what each version added.
BATCH1 = [
    ("v1 graphs", "call1_tests_kernels_batch1_offline_before_scheduler_fix"),
    ("v3 async out", "call7_async_output_batch1_offline_hfset_mixed"),
    ("v4 fused GEMV", "s2_call4_fused_gemv_tests_batch1_profile1"),
    ("v5 persistent+PDL", "s2_call8_persistent_gemv_batch1"),
    ("v6 async sched", "s2_call9_async_scheduling_tests_batch1_profile1"),
    ("v6 again", "s2_call10_engine_tests_batch1_offline_hfset"),
]
OFFLINE = [
    ("v1", "call1_tests_kernels_batch1_offline_before_scheduler_fix"),
    ("v2 scheduler", "call2_batch1_offline_mixed"),
    ("v3 async out", "call7_async_output_batch1_offline_hfset_mixed"),
    ("v5 warm", "s2_call7_offline_this_tree"),
    ("v6", "s2_call10_engine_tests_batch1_offline_hfset"),
    ("v6 fresh GPU", "s2_call12_offline_fresh_machine_mixed_warmup"),
]
CHAIN = [  # (label, call in gemv.json, variant)
    ("cuBLAS", "call7", "cublas"),
    ("first GEMV", "call1", "skinny_pdl"),
    ("whole rows", "call3", "skinny_pdl"),
    ("persistent+PDL", "call7", "skinny_best_pdl"),
]
READ_TBPS = 4.66  # the read-only stream measured by gemv_sweep.py (calls 2 and 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "engine" / "gpu.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = json.loads((RESULTS / "engine" / "gpu.json").read_text())["calls"]
    gemv = json.loads((RESULTS / "kernels" / "gemv.json").read_text())
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))

    chain_bytes = gemv[CHAIN[0][1]]["chain"]["bytes"]
    panels = [
        ("batch-1 decode, Llama-3-8B shape, bf16", "tokens/s", "tab:blue", "{:.0f}",
         [(label, calls[key]["batch1"]["decode_tok_s"]) for label, key in BATCH1],
         (241, "--", "tab:red", "target: 85% MBU (241 tok/s)")),
        ("offline 1000 x 256 in / 256 out", "output tokens/s", "tab:green", "{:,.0f}",
         [(label, calls[key]["offline"]["output_tok_s"]) for label, key in OFFLINE],
         (14000, "--", "tab:red", "target: 14,000 tok/s")),
        ("one step's projections (one row, in a CUDA graph)", "ms", "tab:purple", "{:.2f}",
         [(label, gemv[call]["chain"][variant]["us"] / 1e3) for label, call, variant in CHAIN],
         (chain_bytes / (READ_TBPS * 1e9), ":", "tab:gray", f"weights at {READ_TBPS} TB/s read")),
    ]
    for ax, (title, unit, color, fmt, bars, (line, style, line_color, line_label)) in zip(
            axes, panels, strict=True):
        values = [v for _, v in bars]
        ax.bar([label for label, _ in bars], values, color=color)
        ax.axhline(line, color=line_color, ls=style, label=line_label)
        ax.set_title(title)
        ax.set_ylabel(unit)
        for i, v in enumerate(values):
            ax.text(i, v * 1.01, fmt.format(v), ha="center", fontsize=8)
        ax.set_ylim(0, max(*values, line) * 1.15)

    for ax in axes:
        ax.legend(loc="lower right", fontsize=8)
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    fig.suptitle("tidegate on one H200 (benchmarks/results/engine/gpu.md)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
