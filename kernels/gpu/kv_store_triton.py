"""The Triton KV-cache store: each token's key and value into its paged cache slot.

Same contract as ``store_kv_ref`` (``kernels/cpu/paged_attention.py``), but padding slots (< 0) are
masked inside the kernel instead of filtered on the host, so the store never syncs with the
device and can be captured in a CUDA graph. One program per token writes all of its heads.
An FP8 cache (``torch.float8_e4m3fn``, ``--kv-cache-dtype fp8``) takes the values saturated to
e4m3's range, with a scale of 1 (the attention kernels read them back as they are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The largest finite float8 e4m3 (``torch.float8_e4m3fn``), the FP8 KV cache's element.
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A padding token's whole tile is masked off: nothing is read, nothing is written.
    mask = (heads < num_heads) & (dims < head_dim) & (slot >= 0)
    # The caches are contiguous [num_blocks, block_size, Hk, D], so slot
    # block_id * block_size + offset is simply row `slot` of a [num_slots, Hk * D] view.
    cache_offsets = slot * (num_heads * head_dim) + heads * head_dim + dims
    k = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    v = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims,
                mask=mask)
    if key_cache_ptr.dtype.element_ty == tl.float8e4nv:  # an FP8 cache (e4m3): saturate
        k = saturate_e4m3(k)
        v = saturate_e4m3(v)
    tl.store(key_cache_ptr + cache_offsets, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def saturate_e4m3(x):
    """x clamped to e4m3's finite range (+-448): e4m3 has no infinity, and a value past its
    largest must not become NaN in the cache."""
    x = x.to(tl.float32)
    return tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)


def _check_tokens(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [T, Hk, D], got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_cache(name: str, cache: torch.Tensor, heads: int, head_dim: int,
                 device: torch.device) -> None:
    if cache.dim() != 4 or cache.shape[2:] != (heads, head_dim):
        raise ValueError(f"{name} must have shape [num_blocks, block_size, {heads}, {head_dim}], "
                         f"got {tuple(cache.shape)}")
    if cache.device != device:
        raise ValueError(f"{name} must be on {device}, got {cache.device}")
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {cache.stride()}")


def check_store_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Raise ValueError naming the first argument of a KV store that is off."""
    _check_tokens("key", key, key.device)
    tokens, heads, head_dim = key.shape
    _check_tokens("value", value, key.device)
    if value.shape != key.shape:
        raise ValueError(f"value must have shape {tuple(key.shape)}, got {tuple(value.shape)}")
    _check_cache("key_cache", key_cache, heads, head_dim, key.device)
    _check_cache("value_cache", value_cache, heads, head_dim, key.device)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache must have shape {tuple(key_cache.shape)}, "
                         f"got {tuple(value_cache.shape)}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping must have shape ({tokens},), "
                         f"got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    if slot_mapping.device != key.device:
        raise ValueError(f"slot_mapping must be on {key.device}, got {slot_mapping.device}")


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hk, D] (any token/head strides) into the caches
    [num_blocks, block_size, Hk, D] at slot_mapping [T] int64, cast to the cache dtype.

    Slots < 0 are skipped. Slots are not range-checked (that would sync with the device):
    each must be below num_blocks * block_size.
    """
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    tokens, heads, head_dim = key.shape
    if tokens == 0 or heads == 0 or head_dim == 0:
        return
    block_h = triton.next_power_of_2(heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        heads,
        head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        # 8 heads x 128 dims is 1024 elements: 8 per thread at 4 warps (two 128-bit accesses).
        num_warps=min(max(block_h * block_d // 256, 1), 8),
    )
