"""Weight-only INT4/INT8 decode projections on the GPU: the tiles of ``int_linear_triton``.

For Llama-3-8B's decode projections (qkv with its norm, o_proj with the residual add, gate_up
with norm and SiLU, down_proj with the add) at 1 and 4 rows, in INT4 with groups of 128 and INT8
per channel: every candidate tile (``candidates``: at 1-2 rows the integer-dot GEMV's
``IntGemvConfig`` and the FMA path's best earlier tiles; beyond, ``IntLinearConfig``'s
tensor-core tiles), the default among them. Per
shape it reports the best tile, its time, its effective bandwidth (bytes of qweight + scales +
zeros over the time) and its relative error against the dequantized float32 reference, beside
the bf16 ``skinny_linear_triton`` on the same shape (default tiles, without PDL, as this kernel
has none) and what that one streams.

Every timing replays a CUDA graph of calls on rotating weight copies (more bytes than the 60 MB
L2), so the L2 serves no weights (``gemv_sweep.graph_time_us``).

    python -m tidegate.benchmarks.kernels.int_gemv_sweep --out $OUT/int_gemv.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[2]

from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.benchmarks.kernels.gemv_sweep import graph_time_us  # noqa: E402
from tidegate.kernels.gpu.int_gemv_triton import IntGemvConfig  # noqa: E402
from tidegate.kernels.gpu.int_gemv_triton import default_config as gemv_default  # noqa: E402
from tidegate.kernels.gpu.int_linear_triton import (  # noqa: E402
    IntLinearConfig,
    default_config,
    int_linear_triton,
)
from tidegate.kernels.gpu.linear_triton import skinny_linear_triton  # noqa: E402
from tidegate.kernels.reference.activation import silu_and_mul_ref  # noqa: E402
from tidegate.kernels.reference.rmsnorm import rms_norm_ref  # noqa: E402
from tidegate.kernels.weights.int_weight import IntWeight  # noqa: E402

H, INTER = 4096, 14336
SHAPES = {  # name: (weight rows, K, silu, norm, add)
    "qkv": (6144, H, False, True, False),
    "o": (H, H, False, False, True),
    "gate_up": (2 * INTER, H, True, True, False),
    "down": (H, INTER, False, False, True),
}
FORMATS = {"int4-g128": (4, 128), "int8-channel": (8, None)}  # name: (bits, group; None = K)
BF = torch.bfloat16


def candidates(m: int, bits: int) -> list[IntLinearConfig | IntGemvConfig]:
    """The tiles tried: up to 2 rows, the integer-dot GEMV's blocks of 1-8 rows in programs of
    1-8 warps, 2-16 per SM, and the FMA path's earlier best; beyond, tensor-core tiles."""
    per_byte = 8 // bits  # columns per byte
    dot = [IntLinearConfig(block_m=16, block_n=bn, block_k=bk, num_warps=4, num_stages=s,
                           dot=True)
           for bn, bk, s in ((16, 128, 3), (32, 128, 3), (64, 128, 4), (32, 256, 3))]
    if m > 2:
        return dot
    fma = [IntLinearConfig(block_n=bn, block_k=nbytes * per_byte, num_warps=w)
           for bn, nbytes, w in ((4, 512, 4), (8, 512, 4))]
    gemv = [IntGemvConfig(block_n=bn, per_sm=ps, num_warps=w)
            for bn, ps, w in ((2, 4, 4), (1, 4, 8), (2, 4, 8), (4, 4, 8), (2, 2, 16),
                              (4, 2, 16), (2, 8, 1), (4, 8, 1), (8, 8, 1), (2, 8, 2),
                              (4, 8, 2), (8, 8, 2), (4, 4, 4), (8, 4, 4), (2, 8, 4))]
    return [*gemv, *fma]


def label(c: IntLinearConfig | IntGemvConfig) -> str:
    if isinstance(c, IntGemvConfig):
        return f"dp4a n{c.block_n} sm{c.per_sm} w{c.num_warps}"
    kind = f"dot m{c.block_m}" if c.dot else "fma"
    return f"{kind} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


class Problem:
    """Rotating weight copies of one projection shape and format, at ``m`` rows."""

    def __init__(self, shape: str, fmt: str, m: int, min_bytes: int = 300 << 20) -> None:
        self.n_rows, self.k, self.silu, norm, add = SHAPES[shape]
        self.bits, group = FORMATS[fmt]
        self.group = group or self.k
        self.m = m
        n_out = self.n_rows // 2 if self.silu else self.n_rows
        one = self._weight()
        self.bytes = one.qweight.numel() + one.scales.numel() * 4 + one.zeros.numel()
        copies = max(2, -(-min_bytes // self.bytes))
        self.ws = [one] + [self._weight() for _ in range(copies - 1)]
        self.x = torch.randn(m, self.k, dtype=BF, device="cuda")
        self.kw: dict[str, object] = {"silu": self.silu}
        if norm:
            self.kw["norm_weight"] = (1 + 0.1 * torch.randn(self.k, device="cuda")).to(BF)
        if add:
            self.kw["add"] = torch.randn(m, n_out, dtype=BF, device="cuda")

    def _weight(self) -> IntWeight:
        top = (1 << self.bits) - 1
        q = torch.randint(0, top + 1, (self.n_rows, self.k), device="cuda")
        groups = self.k // self.group
        scales = torch.rand(self.n_rows, groups, device="cuda") * 0.02 / top + 1e-4
        zeros = torch.full((self.n_rows, groups), (top + 1) // 2, device="cuda")
        return IntWeight.from_ints(q, scales, zeros, self.bits)

    def calls(self, cfg: IntLinearConfig | IntGemvConfig | None) -> list[Callable[[], object]]:
        return [lambda w=w: int_linear_triton(self.x, w, config=cfg, **self.kw) for w in self.ws]

    def rel_err(self, cfg: IntLinearConfig | IntGemvConfig | None) -> float:
        # The float32 reference, spelled out: tidegate.kernels.cpu.linear would pull in gguf.
        got = int_linear_triton(self.x, self.ws[0], config=cfg, **self.kw).float()
        x = self.x.float()
        if "norm_weight" in self.kw:
            x = rms_norm_ref(x, self.kw["norm_weight"].float(), 1e-5)[0]
        want = F.linear(x, self.ws[0].dequantize())
        if self.silu:
            want = silu_and_mul_ref(want)
        if "add" in self.kw:
            want = want + self.kw["add"].float()
        return ((got - want).norm() / want.norm()).item()

    def skinny_us(self, fp8: bool = False) -> tuple[float, int]:
        """The bf16 skinny kernel on the same shape (default tiles, no PDL), or the same kernel
        over e4m3 weights with row scales (``fp8``), and the bytes it streams."""
        nbytes = self.n_rows * self.k * (1 if fp8 else 2) + (4 * self.n_rows if fp8 else 0)
        ws = [torch.empty(self.n_rows, self.k, dtype=BF, device="cuda").normal_(std=0.02)
              for _ in range(max(2, -(-(300 << 20) // nbytes)))]
        scale = {}
        if fp8:
            ws = [w.to(torch.float8_e4m3fn) for w in ws]
            scale = {"weight_scale": torch.rand(self.n_rows, device="cuda") * 0.01}
        us = graph_time_us([lambda w=w: skinny_linear_triton(self.x, w, pdl=False, **scale,
                                                             **self.kw)
                            for w in ws], replays=5)
        return us, nbytes


def sweep_one(shape: str, fmt: str, m: int) -> dict[str, object]:
    p = Problem(shape, fmt, m)
    n = p.n_rows // 2 if p.silu else p.n_rows
    default: IntLinearConfig | IntGemvConfig = (
        gemv_default(n, p.k, p.bits, p.silu) if m <= 2
        else default_config(m, n, p.k, p.group, p.bits))
    grid = candidates(m, p.bits)
    if default not in grid:
        grid.append(default)
    rows = []
    for cfg in grid:
        try:
            us = graph_time_us(p.calls(cfg), replays=5)
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            rows.append({"config": label(cfg), "error": repr(e)[:200]})
            continue
        rows.append({"config": label(cfg), "us": us, "TBps": p.bytes / us / 1e6,
                     "default": cfg == default})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    best_cfg = next(c for c in grid if label(c) == ok[0]["config"])
    skinny_us, skinny_bytes = p.skinny_us()
    fp8_us, fp8_bytes = p.skinny_us(fp8=True) if m <= 2 else (float("nan"), 0)
    res = {"bytes": p.bytes, "best": ok[0]["config"], "best_config": asdict(best_cfg),
           "us": ok[0]["us"], "TBps": ok[0]["TBps"], "rel_err": p.rel_err(best_cfg),
           "default": label(default),
           "default_us": next((r["us"] for r in rows if r.get("default")), None),
           "skinny_bf16_us": skinny_us, "skinny_bf16_TBps": skinny_bytes / skinny_us / 1e6,
           "fp8_stream_us": fp8_us, "fp8_stream_TBps": fp8_bytes / fp8_us / 1e6,
           "rows": rows}
    print(f"{shape:8s} {fmt:13s} m{m}: best {res['best']:26s} {res['us']:7.2f} us "
          f"{res['TBps']:.2f} TB/s (err {res['rel_err']:.1e}; default {res['default_us']:.2f} "
          f"us) | bf16 skinny {skinny_us:.2f} us {res['skinny_bf16_TBps']:.2f} TB/s | fp8 "
          f"{fp8_us:.2f} us {res['fp8_stream_TBps']:.2f} TB/s", flush=True)
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"   {len(errors)} failed, e.g. {errors[0]}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("int_gemv.json"))
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 4])
    args = ap.parse_args()
    result: dict[str, object] = {**record.record(), "device": torch.cuda.get_device_name(),
                                 "torch": torch.__version__, "triton": triton.__version__,
                                 "sweep": {}}
    t0 = time.time()
    for m in args.rows:
        for fmt in args.formats:
            for shape in args.shapes:
                result["sweep"][f"{shape}/{fmt}/m{m}"] = sweep_one(shape, fmt, m)
                torch.cuda.empty_cache()
                args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.time() - t0
    args.out.write_text(json.dumps(result, indent=1))
    print(f"[done in {result['seconds']:.0f} s] -> {args.out}")


if __name__ == "__main__":
    main()
