"""Launch shapes of the fused MoE kernels (``tidegate.kernels.gpu.moe_triton``) on the GPU: each candidate
``MoeTiles`` timed on the expert layers of Mixtral-8x7B and Qwen3-30B-A3B at a decode of one
token, a decode step of 1024 sequences and a prefill step of 16384 tokens (bf16, random
weights), with the bytes and FLOPs each call must move against the copy bandwidth and the
tensor-core peak.

    python3 -m tidegate.benchmarks.kernels.moe_sweep --out moe_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from tidegate.kernels.gpu.moe_triton import MoeTiles, default_tiles, moe_triton  # noqa: E402

# name -> (experts, top_k, hidden, intermediate)
MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
TOKENS = (1, 1024, 16384)


def candidates(tokens: int, top_k: int, experts: int) -> list[MoeTiles]:
    if tokens * top_k <= 16 * experts:
        return [MoeTiles(16, n, k, w, s) for n, k, w, s in itertools.product(
            (32, 64, 128), (64, 128, 256), (4,), (2, 3, 4))]
    return [MoeTiles(m, n, k, w, s) for m, n, k, w, s in itertools.product(
        (64, 128), (64, 128), (32, 64), (4, 8), (3, 4))]


def time_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="moe_sweep.json")
    args = ap.parse_args()
    rows = []
    for model, (experts, top_k, hidden, inter) in MODELS.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        router = torch.randn(experts, hidden, device="cuda", generator=g).bfloat16()
        w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g)
               * hidden ** -0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g)
              * inter ** -0.5).bfloat16()
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
            used = min(experts, tokens * top_k)
            bytes_moved = used * 3 * hidden * inter * 2
            flops = tokens * top_k * 3 * hidden * inter * 2
            default = default_tiles(tokens * top_k, experts)
            def call(t: MoeTiles, x: torch.Tensor = x, router: torch.Tensor = router,
                     w13: torch.Tensor = w13, w2: torch.Tensor = w2, k: int = top_k) -> None:
                moe_triton(x, router, w13, w2, k, tiles=t)

            for tiles in [default, *candidates(tokens, top_k, experts)]:
                try:
                    ms = time_ms(lambda t=tiles: call(t))
                except Exception as exc:  # noqa: BLE001 - a shape the compiler refuses
                    print(model, tokens, tiles, "failed:", str(exc)[:120], flush=True)
                    continue
                row = {"model": model, "tokens": tokens,
                       "tiles": [getattr(tiles, f) for f in MoeTiles.__slots__],
                       "default": tiles is default, "ms": ms,
                       "TBps": bytes_moved / ms / 1e9, "TFLOPs": flops / ms / 1e9}
                rows.append(row)
            best = min((r for r in rows if r["model"] == model and r["tokens"] == tokens),
                       key=lambda r: r["ms"])
            dflt = next(r for r in rows if r["model"] == model and r["tokens"] == tokens
                        and r["default"])
            print(f"{model} T={tokens}: default {dflt['ms']:.3f} ms, best {best['ms']:.3f} ms "
                  f"{best['tiles']} ({best['TBps']:.2f} TB/s, {best['TFLOPs']:.0f} TFLOP/s)",
                  flush=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
