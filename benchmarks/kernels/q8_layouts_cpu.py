"""The CPU's 8-bit-activation projections in both weight layouts, on every path this CPU builds.

A decode step of the default model (SmolLM2-135M, Q4_1 projections, a tied Q8_0 LM head) is its
projections at a few rows of x. This times each projection shape of that model in the rows
layout (the file's) and repacked to lanes8 (``csrc/q8_lanes8_cpu.c``), at 1, 4, 16 and 128 rows,
with the kernels as built for this CPU and with the AVX2 path forced (``TIDEGATE_NO_AVX512``:
an AVX-512 machine then runs what a Zen 3 or an older Intel part runs). Calls alternate between
the layouts, rounds interleaved; each figure is the median of ``--repeats`` rounds. Both
layouts give the same bits (checked here before timing).

    python -m tidegate.benchmarks.kernels.q8_layouts_cpu --threads 2 \\
        --out benchmarks/results/engine/q8_layouts_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tidegate.benchmarks.harness.measure import record
from tidegate.kernels.cpu.native_cpu import NativeCpuKernels, build, native_kernels
from tidegate.kernels.weights.packed_weight import LANES8, PackedWeight

T = GGMLQuantizationType
# The default model's projections: (rows, columns, type).
SHAPES = {"qkv": (960, 576, T.Q4_1), "o": (576, 576, T.Q4_1), "gate_up": (3072, 576, T.Q4_1),
          "down": (576, 1536, T.Q4_1), "lm_head": (49152, 576, T.Q8_0)}
PATHS = {"native": (), "avx2": ("TIDEGATE_NO_AVX512",)}


def weight(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> PackedWeight:
    values = rng.standard_normal((rows, cols)).astype(np.float32) / cols**0.5
    return PackedWeight.from_bytes(qtype, (rows, cols), quantize(values, qtype)
                                   ).with_activations("int8")


def time_call(kernels: NativeCpuKernels, x: torch.Tensor, w: PackedWeight, budget_s: float
              ) -> float:
    """Microseconds per call, over about ``budget_s``."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s or calls < 3:
        kernels.packed_linear(x, w)
        calls += 1
    return elapsed / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 128])
    ap.add_argument("--budget-s", type=float, default=0.2, help="per timed figure and round")
    ap.add_argument("--out", default="benchmarks/results/engine/q8_layouts_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    native = native_kernels()
    if native is None:
        raise SystemExit("the native kernels do not build here")
    builds = {name: native if not defines else NativeCpuKernels(build(defines=defines))
              for name, defines in PATHS.items()}
    weights = {name: weight(*shape, rng) for name, shape in SHAPES.items()}
    results = []
    for path, kernels in builds.items():
        for name, rows_w in weights.items():
            lanes_w = kernels.repack_lanes8(rows_w, force=True)
            assert lanes_w.parts[0].layout == LANES8
            for m in args.rows:
                x = torch.from_numpy(rng.standard_normal((m, rows_w.shape[1])).astype(np.float32))
                assert torch.equal(kernels.packed_linear(x, rows_w),
                                   kernels.packed_linear(x, lanes_w)), (path, name, m)
                rounds: dict[str, list[float]] = {"rows": [], "lanes8": []}
                for _ in range(args.repeats):
                    rounds["rows"].append(time_call(kernels, x, rows_w, args.budget_s))
                    rounds["lanes8"].append(time_call(kernels, x, lanes_w, args.budget_s))
                row = {"path": path, "q8_path": kernels.q8_path, "projection": name,
                       "shape": list(SHAPES[name][:2]), "type": SHAPES[name][2].name, "m": m,
                       "rows_us": statistics.median(rounds["rows"]),
                       "lanes8_us": statistics.median(rounds["lanes8"]), "rounds_us": rounds}
                row["speedup"] = row["rows_us"] / row["lanes8_us"]
                results.append(row)
                print(f"{path:7s} {name:8s} m={m:<4d} rows {row['rows_us']:9.1f} us  "
                      f"lanes8 {row['lanes8_us']:9.1f} us  {row['speedup']:.2f}x", flush=True)
    # A decode step's projections at one row: 30 layers of the four, plus the LM head.
    step = {path: {layout: sum((30 if r["projection"] != "lm_head" else 1) * r[f"{layout}_us"]
                               for r in results if r["path"] == path and r["m"] == 1)
                   for layout in ("rows", "lanes8")} for path in builds}
    for path, s in step.items():
        print(f"{path}: one decode step's projections at batch 1: rows {s['rows'] / 1e3:.2f} ms, "
              f"lanes8 {s['lanes8'] / 1e3:.2f} ms ({s['rows'] / s['lanes8']:.2f}x)")
    out = {**record.record(), "threads": args.threads, "repeats": args.repeats, "results": results,
           "batch1_step_projections_us": step}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
