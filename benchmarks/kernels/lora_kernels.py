"""The batched LoRA kernels alone on the GPU: one layer's four projections (Llama-3-8B shapes,
8 rank-16 adapters in bf16, rows spread uniformly over them) per tile configuration, beside the
base projections' GEMMs on the same rows. It chose ``tidegate.kernels.gpu.lora_triton``'s tile constants.

    python -m tidegate.benchmarks.kernels.lora_kernels --out $OUT/lora_kernels_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[2]

import tidegate.kernels.gpu.lora_triton as lt  # noqa: E402
from tidegate.benchmarks.harness.measure import record  # noqa: E402
from tidegate.kernels.ops import lora_rows  # noqa: E402
from tidegate.kernels.reference.lora import LoraStack  # noqa: E402

HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
PROJECTIONS = {"qkv": (HIDDEN, Q + 2 * KV, (Q, Q + KV), True),
               "o": (Q, HIDDEN, (), False),
               "gate_up": (HIDDEN, 2 * INTER, (INTER,), True),
               "down": (INTER, HIDDEN, (), False)}
# (tokens, constant overrides): the defaults against the expand that sums the shrink's
# partials once per column tile (EXPAND_PROGRAMS huge: no grouping), fewer K splits in the
# shrink, other program counts and tiles.
NO_GROUPS = {"EXPAND_PROGRAMS": 1 << 30}
CONFIGS: list[tuple[int, dict[str, int]]] = [
    (1, {}),
    (1, NO_GROUPS),
    (1, {"EXPAND_PROGRAMS": 66}),
    (256, {}),
    (256, NO_GROUPS),
    (256, {"EXPAND_PROGRAMS": 132}),
    (256, {"EXPAND_PROGRAMS": 528}),
    (256, {"SHRINK_PROGRAMS": 32}),
    (256, {"SHRINK_PROGRAMS": 32, "EXPAND_PROGRAMS": 132}),
    (256, {"MAX_BLOCK_N": 128}),
    (256, {"BLOCK_M": 32}),
    (256, {"EXPAND_WARPS": 2}),
    (256, {"EXPAND_WARPS": 1}),
    (256, {"SHRINK_WARPS": 2, "EXPAND_WARPS": 2}),
    (256, {"SHRINK_PROGRAMS": 256}),
    *[(tokens, overrides) for tokens in (600, 1500, 3000)
      for overrides in ({}, NO_GROUPS, {"WIDE_ROWS": 1 << 30}, {"WIDE_ROWS": 1 << 30, **NO_GROUPS})],
    (16384, {"WIDE_ROWS": 1 << 30, **NO_GROUPS}),  # the decode tiles (16 x 64), ungrouped
    (16384, NO_GROUPS),
    (16384, {}),
    (16384, {"WIDE_BLOCK_M": 128, "WIDE_WARPS": 8}),
]


def time_layer(tokens: int, adapters: int, rank: int) -> tuple[float, float, float]:
    """(us for the four LoRAs and the step's layout, us for the layout alone, us for the four
    base GEMMs)."""
    torch.manual_seed(0)
    index = torch.arange(tokens, device="cuda") % adapters
    work = []
    for k, n, segments, normed in PROJECTIONS.values():
        count = len(segments) + 1
        stack = LoraStack(
            (torch.randn(adapters, count * rank, k, device="cuda") / k ** 0.5).bfloat16(),
            (torch.randn(adapters, n, rank, device="cuda") / rank ** 0.5).bfloat16(),
            torch.full((adapters,), 2.0, device="cuda"), segments)
        x = torch.randn(tokens, k, device="cuda").bfloat16()
        y = torch.zeros(tokens, n, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        norm = ((torch.ones(k, device="cuda")).bfloat16(), 1e-5) if normed else None
        work.append((stack, x, y, w, norm))

    def loras() -> None:
        rows = lora_rows(index, adapters)
        for stack, x, y, _, norm in work:
            lt.add_lora_triton(y, x, stack, rows, norm)

    def gemms() -> None:
        for _, x, _, w, _ in work:
            torch.matmul(x, w.T)

    bench = triton.testing.do_bench_cudagraph if tokens <= 256 else triton.testing.do_bench
    return (bench(loras) * 1e3, bench(lambda: lora_rows(index, adapters)) * 1e3,
            bench(gemms) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="*", help="only the configs of these sizes")
    parser.add_argument("--out")
    args = parser.parse_args()
    defaults = {name: getattr(lt, name) for c in CONFIGS for name in c[1]}
    rows = []
    for tokens, overrides in CONFIGS:
        if args.tokens and tokens not in args.tokens:
            continue
        for name, value in {**defaults, **overrides}.items():
            setattr(lt, name, value)
        lora_us, layout_us, base_us = time_layer(tokens, args.adapters, args.rank)
        row = {"tokens": tokens, "overrides": overrides, "lora_us": round(lora_us, 1),
               "layout_us": round(layout_us, 1),
               "base_gemms_us": round(base_us, 1), "ratio": round(lora_us / base_us, 3)}
        rows.append(row)
        print(row, flush=True)
    for name, value in defaults.items():
        setattr(lt, name, value)
    if args.out:
        Path(args.out).write_text(json.dumps({**record.record(), "device": torch.cuda.get_device_name(),
                                              "adapters": args.adapters, "rank": args.rank,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
