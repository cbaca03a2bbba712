"""The Triton rotary embedding: rotates q and k in place, one program per token.

Same math as ``rotary_ref`` (``kernels/reference/rotary.py``): non-interleaved halves, the cache row of
a position holding cos of the D/2 half-dims then their sin, computed in float32 and stored back
in the input dtype. q and k are usually views of one fused qkv tensor, so only their last dim
is assumed contiguous; token and head strides are arguments.

``rotary_store_kv_triton`` also writes the rotated keys and the values into the paged KV cache
(``store_kv_triton``'s contract) from the same program: one launch per layer instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidegate.kernels.gpu.kv_store_triton import check_store_args, saturate_e4m3


@triton.jit
def _rotate_heads(
    base_ptr,
    head_stride,
    num_heads,
    half,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    lo_ptrs = base_ptr + heads * head_stride + dims
    # Both halves are loaded before either is stored: each output half needs the other input.
    x1 = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(lo_ptrs, out1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptrs + half, out2.to(base_ptr.dtype.element_ty), mask=mask)
    return out1, out2


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cache_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cache_row_stride,
    num_q_heads,
    num_k_heads,
    half,
    STORE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # int64: T * the fused qkv width can pass 2**31 on long prefills.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # cos/sin are loaded once per token and shared by all of its q and k heads.
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    cos = tl.load(cache_ptr + pos * cache_row_stride + dims, mask=dim_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_row_stride + half + dims, mask=dim_mask, other=0.0)
    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, num_q_heads, half,
                  cos, sin, BLOCK_HQ, BLOCK_HALF)
    k1, k2 = _rotate_heads(k_ptr + token * k_token_stride, k_head_stride, num_k_heads, half,
                           cos, sin, BLOCK_HK, BLOCK_HALF)
    if STORE:
        # The rotated key (still in registers) and the value go to the token's cache slot: the
        # store_kv kernel's work without its launch. Padding slots (< 0) write nothing.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_HK)[:, None]
        mask = (heads < num_k_heads) & dim_mask & (slot >= 0)
        # Contiguous [num_blocks, block_size, Hk, D] caches: slot s is row s of [slots, Hk * D].
        row = slot * (num_k_heads * 2 * half) + heads * (2 * half) + dims
        dtype = key_cache_ptr.dtype.element_ty
        # Rounded to k's dtype first, as the unfused rotary then store would.
        k1 = k1.to(k_ptr.dtype.element_ty)
        k2 = k2.to(k_ptr.dtype.element_ty)
        v_lo = v_ptr + token * v_token_stride + heads * v_head_stride + dims
        v1 = tl.load(v_lo, mask=mask)
        v2 = tl.load(v_lo + half, mask=mask)
        if dtype == tl.float8e4nv:  # an FP8 cache: saturate into e4m3's range
            k1 = saturate_e4m3(k1)
            k2 = saturate_e4m3(k2)
            v1 = saturate_e4m3(v1)
            v2 = saturate_e4m3(v2)
        tl.store(key_cache_ptr + row, k1.to(dtype), mask=mask)
        tl.store(key_cache_ptr + row + half, k2.to(dtype), mask=mask)
        tl.store(value_cache_ptr + row, v1.to(value_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + row + half, v2.to(value_cache_ptr.dtype.element_ty),
                 mask=mask)


def _check_heads(name: str, t: torch.Tensor, tokens: int, head_dim: int,
                 device: torch.device) -> None:
    if t.dim() != 3 or t.shape[0] != tokens or t.shape[1] < 1 or t.shape[2] != head_dim:
        raise ValueError(f"{name} must have shape [{tokens}, H >= 1, {head_dim}], "
                         f"got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.stride(2) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by positions [T]; returns (q, k).

    cache is ``cos_sin_cache``'s [max_pos, D] float32. Positions are not range-checked (that
    would sync with the device): each must be below max_pos.
    """
    _check_rotary(q, k, positions, cache)
    _launch(q, k, positions, cache, None)
    return q, k


def rotary_store_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_triton`` and then ``store_kv_triton(k, v, key_cache, value_cache,
    slot_mapping)`` in one launch (a decode step's rotary and KV store). Returns (q, k)."""
    _check_rotary(q, k, positions, cache)
    check_store_args(k, v, key_cache, value_cache, slot_mapping)
    _launch(q, k, positions, cache, (v, key_cache, value_cache, slot_mapping))
    return q, k


def _check_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [T, Hq, D], got shape {tuple(q.shape)}")
    tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: head dim must be even, got {head_dim}")
    _check_heads("q", q, tokens, head_dim, q.device)
    _check_heads("k", k, tokens, head_dim, q.device)
    if k.dtype != q.dtype:
        raise ValueError(f"k must have dtype {q.dtype}, got {k.dtype}")
    if positions.shape != (tokens,):
        raise ValueError(f"positions must have shape ({tokens},), got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 or int32, got {positions.dtype}")
    if positions.device != q.device:
        raise ValueError(f"positions must be on {q.device}, got {positions.device}")
    if cache.dim() != 2 or cache.shape[1] != head_dim:
        raise ValueError(f"cache must have shape [max_pos, {head_dim}], "
                         f"got {tuple(cache.shape)}")
    if cache.dtype != torch.float32:
        raise ValueError(f"cache must be float32, got {cache.dtype}")
    if cache.device != q.device:
        raise ValueError(f"cache must be on {q.device}, got {cache.device}")
    if cache.stride(1) != 1:
        raise ValueError(f"cache must have a contiguous last dim, got strides {cache.stride()}")


def _launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    tokens, num_q_heads, head_dim = q.shape
    if tokens == 0:
        return
    v, key_cache, value_cache, slots = store if store is not None else (k, k, k, positions)
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(tokens,)](
        q,
        k,
        v,
        positions,
        cache,
        key_cache,
        value_cache,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cache.stride(0),
        num_q_heads,
        k.shape[1],
        half,
        STORE=store is not None,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half,
        # The q tile dominates: 32 heads x 64 half-dims is 2048 elements, 16 per thread at 4.
        num_warps=min(max(block_hq * block_half // 512, 1), 8),
    )
