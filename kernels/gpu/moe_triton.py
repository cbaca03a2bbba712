"""The fused mixture-of-experts kernels (Triton): grouped expert GEMMs over tokens sorted by
expert, the same result as ``tidegate.kernels.reference.moe.moe_ref``.

The step's (token, slot) pairs are sorted by their expert on the device and each expert's run
padded to whole row tiles (``ExpertLayout``), so one launch covers every expert: a program owns
one tile of one expert's rows and streams that expert's weights once for all of them. The
first kernel computes act(gate) * up for its rows (the gate and up halves of ``w13`` in one
pass), the second multiplies by ``w2`` and the pair's routing weight and writes each pair's row;
the k rows of a token are summed at the end (no atomics: the result does not depend on timing).

Nothing is read back to the host: the tile count depends only on the number of tokens, so a
decode step with experts can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidegate.kernels.reference.moe import ExpertLayout, check_moe, route


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """A launch shape of both kernels: rows per tile (each expert's run is padded to it),
    output columns and reduction depth per step, warps and pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3


def default_tiles(pairs: int, experts: int) -> MoeTiles:
    """The launch shape for ``pairs`` (token, expert) pairs over ``experts``: tiles of 16 rows
    when experts see few tokens each (decode), wider tiles as their runs grow. Measured on the
    H200 (``benchmarks/kernels/moe_sweep.py``, ``benchmarks/results/kernels/moe_sweep.json``): at 1024 tokens
    1.3-1.6x faster than 64 x 64 tiles, at 16384 tokens 1.25-1.47x."""
    if pairs <= 16 * experts:
        return MoeTiles(16, 64, 64, 4, 3)
    if pairs < 128 * experts:
        return MoeTiles(64, 128, 64, 8, 4)
    return MoeTiles(128, 128, 64, 8, 3)


def expert_layout(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """The padded, expert-sorted layout of ``experts`` [T, k], built on the device."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    # scatter_add, not bincount: bincount reads its maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    run_start = counts.cumsum(0) - counts
    rank = torch.arange(pairs, device=dev) - run_start[sorted_experts]
    length = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    slots = torch.full((length,), pairs, dtype=torch.int32, device=dev)
    slots[starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, length, block_m, device=dev)
    block_expert = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
    return ExpertLayout(slots, block_expert, block_m, pairs)


@triton.jit
def _tile_rows(tile, slots_ptr, num_pairs, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """The tile's pairs, which of its rows hold one, and the rows of the intermediate they
    use: the padded layout's slots, or (``DIRECT``) pair ``tile`` alone in the first row."""
    if DIRECT:
        pair = tile + tl.zeros([BLOCK_M], dtype=tl.int32)
        valid = tl.arange(0, BLOCK_M) == 0
        rows = pair
    else:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slots_ptr + rows)
        valid = pair < num_pairs
    return pair, valid, rows


@triton.jit(do_not_specialize=["num_pairs"])  # rows vary by step: not a compile key
def _gate_up_kernel(
    x_ptr, w_ptr, slots_ptr, block_expert_ptr, out_ptr,
    num_pairs, hidden, inter, num_experts,
    stride_xt, stride_we, stride_wn, stride_or,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GELU: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):
    """One (row tile, column tile): act(x @ gate.T) * (x @ up.T) for the tile's pairs.
    ``DIRECT``: tile i is pair i alone (its first row), ``block_expert`` the pairs' experts."""
    tile = tl.program_id(0)
    expert = tl.load(block_expert_ptr + tile)
    if expert >= num_experts:
        return
    pair, valid, rows = _tile_rows(tile, slots_ptr, num_pairs, BLOCK_M, DIRECT)
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w + cols[:, None] * stride_wn + (k0 + ks)[None, :],
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(w + (cols + inter)[:, None] * stride_wn + (k0 + ks)[None, :],
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        gate = tl.dot(a, tl.trans(wg), gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, tl.trans(wu), up, input_precision=DOT_PRECISION)
    if GELU:
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :],
             (act * up).to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # rows vary by step: not a compile key
def _down_kernel(
    h_ptr, w_ptr, slots_ptr, block_expert_ptr, weights_ptr, out_ptr,
    num_pairs, hidden, inter, num_experts,
    stride_hr, stride_we, stride_wn, stride_op,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):
    """One (row tile, column tile): routing weight * (h @ down.T), written to each pair's row."""
    tile = tl.program_id(0)
    expert = tl.load(block_expert_ptr + tile)
    if expert >= num_experts:
        return
    pair, valid, rows = _tile_rows(tile, slots_ptr, num_pairs, BLOCK_M, DIRECT)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + ks < inter
        h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_hr + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w + cols[:, None] * stride_wn + (k0 + ks)[None, :],
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(wd), acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    safe = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_op + cols[None, :], acc * weight[:, None],
             mask=valid[:, None] & col_ok[None, :])


def moe_triton(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               top_k: int, *, renormalize: bool = True, activation: str = "silu",
               tiles: MoeTiles | None = None) -> torch.Tensor:
    """``tidegate.kernels.reference.moe.moe_ref`` in two fused launches (plus the router and the layout);
    ``tiles``: the launch shape (default ``default_tiles``)."""
    check_moe(x, router, w13, w2, top_k)
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w2.shape[2]
    routing = route(x @ router.T, top_k, renormalize)
    pairs = tokens * top_k
    t = tiles or default_tiles(pairs, experts)
    if tiles is None and x.element_size() > 2:
        # float32 tiles take twice the shared memory a stage: two stages fit where bf16's
        # three or four do (the H200's 227 KiB).
        t = MoeTiles(t.block_m, t.block_n, t.block_k, t.warps, min(t.stages, 2))
    block_m = t.block_m
    # One token (batch-1 decode): its k experts are distinct, so each pair is a tile of its
    # own and the layout needs no sort, which at one token costs more than the experts.
    direct = tokens == 1
    if direct:
        slots = block_expert = routing.experts.reshape(-1).to(torch.int32)
        num_tiles = length = pairs
    else:
        layout = expert_layout(routing.experts, experts, block_m)
        slots, block_expert = layout.slots, layout.block_expert
        length = slots.numel()
        num_tiles = length // block_m
    h = torch.empty((length, inter), dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if tokens:
        _gate_up_kernel[(num_tiles, triton.cdiv(inter, t.block_n))](
            x, w13, slots, block_expert, h, pairs, hidden, inter, experts,
            x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
            TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            GELU=activation == "gelu_tanh", DOT_PRECISION=precision, DIRECT=direct,
            num_warps=t.warps, num_stages=t.stages,
        )
    # Every pair's row is written (a pair is in exactly one tile): no zeroing.
    out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    if tokens:
        _down_kernel[(num_tiles, triton.cdiv(hidden, t.block_n))](
            h, w2, slots, block_expert, routing.weights.reshape(-1).contiguous(),
            out, pairs, hidden, inter, experts,
            h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_PRECISION=precision,
            DIRECT=direct, num_warps=t.warps, num_stages=t.stages,
        )
    return out.view(tokens, top_k, hidden).sum(1).to(x.dtype)


__all__ = ["ExpertLayout", "MoeTiles", "default_tiles", "expert_layout", "moe_triton"]
