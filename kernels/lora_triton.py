"""Batched LoRA on the GPU (Triton): the same result as ``kernels.lora.add_lora_ref``.

Rows are sorted by adapter on the device and each adapter's run padded to whole row tiles
(``kernels.moe_triton.expert_layout``: a LoRA step is a mixture of experts that routes each
row to one expert, its adapter), so each tile streams its adapter's matrices once for all its
rows. The shrink writes ``x @ a.T`` [T, R] in float32; the expand multiplies by ``b`` and the
adapter's scale and adds to ``y`` in place. Rows without an adapter form a run of their own,
which no program computes. Nothing is read back to the host, so a decode step with adapters
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora import NO_ADAPTER, LoraStack, check_lora
from kernels.moe_triton import expert_layout

BLOCK_M = 16  # rows per tile: decode batches give each adapter a few rows


@triton.jit
def _tile_tokens(tile, slots_ptr, tokens, BLOCK_M: tl.constexpr):
    """Which of the tile's rows hold a token (the rest pad the adapter's run), and the
    tokens (0 in padding rows, masked off)."""
    row = tl.load(slots_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = row < tokens
    return valid, tl.where(valid, row, 0).to(tl.int64)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, block_adapter_ptr, h_ptr, tokens, k_dim, rank,
                   num_adapters, stride_xt, stride_ae, stride_ar, stride_ht,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    adapter = tl.load(block_adapter_ptr + tile)
    if adapter >= num_adapters:
        return
    valid, token = _tile_tokens(tile, slots_ptr, tokens, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + adapter.to(tl.int64) * stride_ae
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = k0 + ks < k_dim
        xs = tl.load(x_ptr + token[:, None] * stride_xt + (k0 + ks)[None, :],
                     mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(a + rs[:, None] * stride_ar + (k0 + ks)[None, :],
                    mask=(rs < rank)[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xs, tl.trans(w), acc, input_precision=DOT_PRECISION)
    tl.store(h_ptr + token[:, None] * stride_ht + rs[None, :], acc,
             mask=valid[:, None] & (rs < rank)[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, scale_ptr, slots_ptr, block_adapter_ptr, y_ptr, tokens, n_dim,
                   rank, num_adapters, stride_ht, stride_be, stride_bn, stride_yt,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    adapter = tl.load(block_adapter_ptr + tile)
    if adapter >= num_adapters:
        return
    valid, token = _tile_tokens(tile, slots_ptr, tokens, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_dim
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    b = tl.load(b_ptr + adapter.to(tl.int64) * stride_be + cols[:, None] * stride_bn
                + rs[None, :], mask=col_ok[:, None] & r_ok[None, :], other=0.0)
    h = tl.load(h_ptr + token[:, None] * stride_ht + rs[None, :],
                mask=valid[:, None] & r_ok[None, :], other=0.0).to(b.dtype)
    delta = tl.dot(h, tl.trans(b), input_precision=DOT_PRECISION) * tl.load(scale_ptr + adapter)
    ptrs = y_ptr + token[:, None] * stride_yt + cols[None, :]
    mask = valid[:, None] & col_ok[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, stack: LoraStack,
                    index: torch.Tensor) -> None:
    """``kernels.lora.add_lora_ref`` in two launches (plus the layout)."""
    check_lora(y, x, stack, index)
    tokens, k_dim = x.shape
    if tokens == 0:
        return
    adapters, n_dim = stack.num_adapters, y.shape[1]
    rank = stack.a.shape[1]
    for name, t in (("x", x), ("y", y), ("a", stack.a), ("b", stack.b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    # Rows without an adapter become adapter L: a run that no program computes.
    routed = torch.where(index == NO_ADAPTER, adapters, index).to(torch.int64)[:, None]
    layout = expert_layout(routed, adapters + 1, BLOCK_M)
    num_tiles = layout.slots.numel() // BLOCK_M
    block_r = max(16, triton.next_power_of_2(rank))
    h = torch.empty((tokens, rank), dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _shrink_kernel[(num_tiles,)](
        x, stack.a, layout.slots, layout.block_expert, h, tokens, k_dim, rank, adapters,
        x.stride(0), stack.a.stride(0), stack.a.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64, DOT_PRECISION=precision)
    block_n = 64
    _expand_kernel[(num_tiles, triton.cdiv(n_dim, block_n))](
        h, stack.b, stack.scale, layout.slots, layout.block_expert, y, tokens, n_dim, rank,
        adapters, h.stride(0), stack.b.stride(0), stack.b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r, DOT_PRECISION=precision)
