"""FP8 W8A8 GEMMs on the GPU: the tiles of ``tidegate.kernels.gpu.fp8_linear_triton`` against cuBLAS.

For Llama-3-8B's projections at the row counts of offline serving (a decode step of 256-1024
sequences, a prefill chunk of 4096-16384 tokens): every candidate ``Fp8GemmConfig`` of the
Triton W8A8 GEMM (activation quantization included, and alone), beside cuBLAS's FP8 GEMM with
the same row-wise scales (``torch._scaled_mm``, per-token activation and per-channel weight
scales, on the same e4m3 operands) and cuBLAS's bf16 GEMM (``F.linear``, what the engine runs
for bf16 weights). Each timing is the median of CUDA-event-timed repeats after a warm-up.

    python -m tidegate.benchmarks.kernels.fp8_gemm_sweep --out $OUT/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.harness.measure.cuda_timing import cuda_time_ms  # noqa: E402
from tidegate.kernels.gpu.fp8_linear_triton import (  # noqa: E402
    Fp8GemmConfig,
    default_config,
    fp8_linear_triton,
    quantize_rows_fp8,
)
from tidegate.kernels.weights.fp8_weight import Fp8Weight  # noqa: E402

H, INTER = 4096, 14336
SHAPES = {"qkv": (6144, H, False), "o": (H, H, False), "gate_up": (2 * INTER, H, False),
          "gate_up_silu": (2 * INTER, H, True), "down": (H, INTER, False)}
BF = torch.bfloat16


def candidates() -> list[Fp8GemmConfig]:
    return [Fp8GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=w,
                          num_stages=s)
            for bm, bn, bk, w, s in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4),
                                     (128, 256, 128, 8, 3), (128, 64, 128, 4, 4),
                                     (64, 128, 128, 4, 4), (128, 128, 64, 4, 5),
                                     (64, 64, 128, 4, 4), (256, 128, 128, 8, 3))]


def label(c: Fp8GemmConfig) -> str:
    return f"m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


def sweep_one(shape: str, m: int) -> dict[str, object]:
    n_rows, k, silu = SHAPES[shape]
    n = n_rows // 2 if silu else n_rows
    w = Fp8Weight.quantize(torch.randn(n_rows, k, device="cuda") / k**0.5)
    x = torch.randn(m, k, device="cuda", dtype=BF)
    flop = 2 * m * n_rows * k
    rows = []
    default = default_config(m, n, k, silu)
    grid = candidates()
    if default not in grid:
        grid.append(default)
    for cfg in grid:
        try:
            ms = cuda_time_ms(lambda cfg=cfg: fp8_linear_triton(x, w, silu=silu, config=cfg))
        except Exception as e:  # noqa: BLE001 - a tile that does not fit: report it
            rows.append({"config": label(cfg), "error": repr(e)[:200]})
            continue
        rows.append({"config": label(cfg), "ms": ms, "TFLOPs": flop / ms / 1e9,
                     "default": cfg == default, "tile": asdict(cfg)})
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    quant_ms = cuda_time_ms(lambda: quantize_rows_fp8(x))
    q, xs = quantize_rows_fp8(x)
    res: dict[str, object] = {"m": m, "n_rows": n_rows, "k": k, "silu": silu,
                              "best": ok[0]["config"], "best_ms": ok[0]["ms"],
                              "best_TFLOPs": ok[0]["TFLOPs"],
                              "default_ms": next(r["ms"] for r in ok if r["default"]),
                              "quantize_ms": quant_ms, "rows": rows}
    try:  # cuBLAS FP8 with the same row-wise scales, on the same operands (no quantization)
        res["scaled_mm_ms"] = cuda_time_ms(lambda: torch._scaled_mm(
            q, w.weight.t(), scale_a=xs[:, None], scale_b=w.scales[None, :], out_dtype=BF))
    except Exception as e:  # noqa: BLE001 - not every build has row-wise scaling
        res["scaled_mm_error"] = repr(e)[:200]
    wb = w.dequantize().to(BF)
    res["bf16_cublas_ms"] = cuda_time_ms(lambda: F.linear(x, wb))
    sm = res.get("scaled_mm_ms", float("nan"))
    print(f"{shape:13s} m{m:<6d} triton {res['best']:24s} {res['best_ms']:.3f} ms "
          f"({res['best_TFLOPs']:.0f} TFLOP/s; default {res['default_ms']:.3f}; quant "
          f"{quant_ms:.3f}) | scaled_mm {sm:.3f} | bf16 {res['bf16_cublas_ms']:.3f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("fp8_gemm.json"))
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=[256, 1000, 4096, 16384])
    args = ap.parse_args()
    result: dict[str, object] = {**record.record(), "device": torch.cuda.get_device_name(),
                                 "torch": torch.__version__, "triton": triton.__version__,
                                 "sweep": {}}
    t0 = time.time()
    for m in args.rows:
        for shape in args.shapes:
            result["sweep"][f"{shape}/m{m}"] = sweep_one(shape, m)
            args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.time() - t0
    args.out.write_text(json.dumps(result, indent=1))
    print(f"[done in {result['seconds']:.0f} s] -> {args.out}")


if __name__ == "__main__":
    main()
