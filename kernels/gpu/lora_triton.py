"""Batched LoRA on the GPU (Triton): the same result as ``tidegate.kernels.reference.lora.add_lora_ref``.

Once per step, ``lora_layout`` sorts the rows by adapter on the device and pads each adapter's
run to whole row tiles (``tidegate.kernels.gpu.moe_triton.expert_layout``: a LoRA step is a mixture of
experts that routes each row to one expert, its adapter); a few rows (decode) are a tile each,
unsorted; prefill-sized steps take wider tiles. Rows without an adapter form a run that no
program computes.

Each projection then costs two launches. The shrink streams the tile's adapter's ``a`` once
for all its rows and writes ``x @ a.T`` in float32; when the rows are few it splits K (and the
S*R shrink rows) over programs, each K split writing partial sums of its own: no atomics, so
the result does not depend on timing. With ``norm`` it also sums each row's squares and
multiplies x by the gain as it streams K; 1/rms, a scalar per row, is applied by the expand to
the summed partials. The expand multiplies by ``b`` and the adapter's scale and adds to ``y``
in place. Its column tiles stay inside one segment where the segment offsets allow, so a tile
reads only its segment's R columns of the shrink; else every tile computes all S segments and
keeps each column's own. Where the GPU stays busy, one expand program walks several column tiles
of a segment, summing the shrink's partials once for them all.

Nothing is read back to the host and the tile counts depend only on T and L, so a decode step
with adapters can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidegate.kernels.gpu.moe_triton import ExpertLayout, expert_layout
from tidegate.kernels.reference.lora import NO_ADAPTER, LoraRows, LoraStack, Norm, check_lora

BLOCK_M = 16  # rows per tile: decode batches give each adapter a few rows
# From this many rows (prefill chunks) the tiles are WIDE_BLOCK_M x WIDE_BLOCK_N: with 16 x 64
# a 16k-row chunk launches ~460k tiny expand programs for gate/up alone.
WIDE_ROWS = 1024
WIDE_BLOCK_M = 64
WIDE_BLOCK_N = 128
# Up to this many rows each row is a tile of its own, unsorted. On the H200 (Llama-3-8B shapes,
# rank 16, bf16) the sorted layout costs 45 us a step against 10 us; a layer's four LoRAs took
# the same either way up to 4 rows, 6 us less sorted at 8 rows of one adapter, 5 us at 16 rows.
DIRECT_ROWS = 4
BLOCK_K = 64  # the shrink's reduction step
MIN_DOT = 16  # tl.dot's smallest tile side
MAX_BLOCK_N = 64  # the expand's column tile, where the segment offsets allow it
MAX_SHRINK_R = 64  # shrink rows per program: qkv at rank 64 (192 rows) takes three programs
# The shrink splits K until about this many programs share it when the rows are few (an H200
# has 132 SMs); a split keeps at least MIN_SPLIT_CHUNKS steps of BLOCK_K, and there are at most
# MAX_SPLITS: every expand program adds up all the splits' partial sums.
SHRINK_PROGRAMS = 128
MIN_SPLIT_CHUNKS = 4
MAX_SPLITS = 16
# Warps per program: on the H200 1, 2 and 4 came within 0.5 us of each other at 1 and 8 rows.
SHRINK_WARPS = 4
EXPAND_WARPS = 4
# An expand program covers up to MAX_GROUP_N columns while the step still launches about
# EXPAND_PROGRAMS of them (two an SM on an H200).
MAX_GROUP_N = 2048
EXPAND_PROGRAMS = 264
WIDE_WARPS = 4


def lora_layout(index: torch.Tensor, num_adapters: int) -> ExpertLayout:
    """The step's rows sorted by adapter, each adapter's run padded to ``BLOCK_M``; rows
    without an adapter routed to adapter ``num_adapters``, which no program computes."""
    tokens = index.shape[0]
    routed = torch.where(index == NO_ADAPTER, num_adapters, index)
    if tokens > DIRECT_ROWS:
        return expert_layout(routed.to(torch.int64)[:, None], num_adapters + 1,
                             block_rows(tokens))
    # Tile t holds row t in its first slot; the others hold T, past the last row: padding.
    slots = torch.full((tokens, BLOCK_M), tokens, dtype=torch.int32, device=index.device)
    slots[:, 0] = torch.arange(tokens, dtype=torch.int32, device=index.device)
    return ExpertLayout(slots.view(-1), routed.to(torch.int32), BLOCK_M, tokens)


@triton.jit
def _tile_tokens(tile, slots_ptr, tokens, BLOCK_M: tl.constexpr):
    """Which of the tile's rows hold a token (the rest pad the adapter's run), and the
    tokens (0 in padding rows, masked off)."""
    row = tl.load(slots_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = row < tokens
    return valid, tl.where(valid, row, 0).to(tl.int64)


@triton.jit(do_not_specialize=["tokens"])  # rows vary by step: not a compile key
def _shrink_kernel(x_ptr, gain_ptr, a_ptr, slots_ptr, block_adapter_ptr, h_ptr, ss_ptr,
                   tokens, k_dim, width, num_adapters, k_per_split,
                   stride_xt, stride_ae, stride_ar, stride_hs, stride_ht, stride_ss,
                   NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (row tile, K split, block of shrink rows): the split's partial ``u @ a.T`` (u = x,
    or x * gain with ``NORM``, whose partial sums of squares the first block stores)."""
    tile = tl.program_id(0)
    adapter = tl.load(block_adapter_ptr + tile)
    if adapter >= num_adapters:
        return
    valid, token = _tile_tokens(tile, slots_ptr, tokens, BLOCK_M)
    split = tl.program_id(1)
    rs = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < width
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + adapter.to(tl.int64) * stride_ae
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_dim)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = k0 + ks < k_end
        xs = tl.load(x_ptr + token[:, None] * stride_xt + (k0 + ks)[None, :],
                     mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(a + rs[:, None] * stride_ar + (k0 + ks)[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            # rms_norm(x) = (x * gain) / rms(x): the per-row 1/rms waits for the whole row.
            xf = xs.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            gain = tl.load(gain_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            xs = xf * gain[None, :]
        acc = tl.dot(xs.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PRECISION)
    tl.store(h_ptr + split * stride_hs + token[:, None] * stride_ht + rs[None, :], acc,
             mask=valid[:, None] & r_ok[None, :])
    if NORM:
        if tl.program_id(2) == 0:
            tl.store(ss_ptr + split * stride_ss + token, ss, mask=valid)


@triton.jit
def _segment_h(h_ptr, token, valid, segment, rank, stride_hs, stride_ht,
               NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """The tile's rows of segment ``segment``'s shrink [BLOCK_M, BLOCK_R], float32: the sum of
    the K splits' partials (unrolled, so that their loads are in flight together)."""
    rs = tl.arange(0, BLOCK_R)
    ptrs = h_ptr + token[:, None] * stride_ht + (segment * rank + rs)[None, :]
    mask = valid[:, None] & (rs < rank)[None, :]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        h += tl.load(ptrs + split * stride_hs, mask=mask, other=0.0)
    return h


@triton.jit(do_not_specialize=["tokens"])  # rows vary by step: not a compile key
def _expand_kernel(h_ptr, ss_ptr, b_ptr, scale_ptr, slots_ptr, block_adapter_ptr, y_ptr,
                   tokens, n_dim, k_dim, rank, num_adapters, start1, start2, eps,
                   stride_hs, stride_ht, stride_ss, stride_be, stride_bn, stride_yt,
                   NUM_SPLITS: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                   STRADDLE: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """One (row tile, group of GROUP_N columns): y += scale * h @ b.T over the group's
    segment(s), BLOCK_N columns at a time, the shrink's partials summed once for the group.
    ``start1``, ``start2``: where segments 1 and 2 start (n_dim where there is none)."""
    tile = tl.program_id(0)
    adapter = tl.load(block_adapter_ptr + tile)
    if adapter >= num_adapters:
        return
    valid, token = _tile_tokens(tile, slots_ptr, tokens, BLOCK_M)
    group = tl.program_id(1) * GROUP_N
    rs = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + adapter.to(tl.int64) * stride_be + rs[None, :]
    scale = tl.load(scale_ptr + adapter)
    inv_rms = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if NORM:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for split in tl.static_range(NUM_SPLITS):
            ss += tl.load(ss_ptr + split * stride_ss + token, mask=valid, other=0.0)
        inv_rms = tl.rsqrt(ss / k_dim + eps)
    if STRADDLE:
        # Offsets not on a column tile (GROUP_N == BLOCK_N): every segment's product, each
        # column keeps its own.
        cols = group + tl.arange(0, BLOCK_N)
        col_ok = cols < n_dim
        b = tl.load(b_rows + cols[:, None] * stride_bn,
                    mask=col_ok[:, None] & (rs < rank)[None, :], other=0.0)
        col_segment = (cols >= start1).to(tl.int32) + (cols >= start2).to(tl.int32)
        delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(NUM_SEGMENTS):
            h = _segment_h(h_ptr, token, valid, s, rank, stride_hs, stride_ht, NUM_SPLITS,
                           BLOCK_M, BLOCK_R) * inv_rms[:, None]
            part = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)
            delta = tl.where((col_segment == s)[None, :], part, delta)
        ptrs = y_ptr + token[:, None] * stride_yt + cols[None, :]
        mask = valid[:, None] & col_ok[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + delta * scale).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        segment = (group >= start1).to(tl.int32) + (group >= start2).to(tl.int32)
        h = _segment_h(h_ptr, token, valid, segment, rank, stride_hs, stride_ht, NUM_SPLITS,
                       BLOCK_M, BLOCK_R) * inv_rms[:, None]
        h = h.to(b_ptr.dtype.element_ty)
        for n0 in range(0, GROUP_N, BLOCK_N):
            cols = group + n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n_dim
            b = tl.load(b_rows + cols[:, None] * stride_bn,
                        mask=col_ok[:, None] & (rs < rank)[None, :], other=0.0)
            delta = tl.dot(h, tl.trans(b), input_precision=DOT_PRECISION)
            ptrs = y_ptr + token[:, None] * stride_yt + cols[None, :]
            mask = valid[:, None] & col_ok[None, :]
            y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, (y + delta * scale).to(y_ptr.dtype.element_ty), mask=mask)


def block_rows(tokens: int) -> int:
    """The layout's rows per tile for a step of ``tokens`` rows."""
    return WIDE_BLOCK_M if tokens >= WIDE_ROWS else BLOCK_M


def row_tiles(tokens: int) -> int:
    """About how many of the layout's tiles hold rows: one a row up to ``DIRECT_ROWS``, else
    the padded runs' (plus at most one partial tile an adapter, not counted)."""
    return tokens if tokens <= DIRECT_ROWS else triton.cdiv(tokens, block_rows(tokens))


def shrink_splits(tiles: int, k_dim: int) -> tuple[int, int]:
    """(K splits, K per split) for the shrink over ``tiles`` row tiles: many splits when the
    rows are few (decode), none when their tiles alone fill the GPU (prefill)."""
    chunks = triton.cdiv(k_dim, BLOCK_K)
    wanted = max(1, min(chunks // MIN_SPLIT_CHUNKS, SHRINK_PROGRAMS // tiles, MAX_SPLITS))
    per_split = triton.cdiv(chunks, wanted)
    return triton.cdiv(chunks, per_split), per_split * BLOCK_K


def column_tile(segments: tuple[int, ...], widest: int = MAX_BLOCK_N) -> tuple[int, bool]:
    """(BLOCK_N, straddle): the widest power-of-two tile up to ``widest`` that divides
    every segment offset, so each tile lies in one segment; where none of at least
    ``MIN_DOT`` does, ``widest`` tiles that may straddle (each computes every segment)."""
    block_n = widest
    while block_n >= MIN_DOT and any(start % block_n for start in segments):
        block_n //= 2
    return (block_n, False) if block_n >= MIN_DOT else (widest, True)


def column_group(n_dim: int, segments: tuple[int, ...], block_n: int, straddle: bool,
                 tiles: int) -> int:
    """GROUP_N, the columns one expand program covers: the widest power-of-two multiple of
    ``block_n`` (up to ``MAX_GROUP_N``) that divides every segment offset and still gives the
    ``tiles`` row tiles about ``EXPAND_PROGRAMS`` programs. Each program sums the shrink's
    K-split partials once for all its columns, instead of once per column tile."""
    group = block_n
    if straddle:
        return group
    while (group < n_dim and group * 2 <= MAX_GROUP_N
           and not any(start % (group * 2) for start in segments)
           and tiles * triton.cdiv(n_dim, group * 2) >= EXPAND_PROGRAMS):
        group *= 2
    return group


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, rows: LoraRows,
                    norm: Norm | None = None) -> None:
    """``tidegate.kernels.reference.lora.add_lora_ref`` in two launches, over the layout ``rows`` carries."""
    check_lora(y, x, stack, rows, norm)
    layout = rows.layout
    if layout is None or layout.block_m != block_rows(x.shape[0]):
        raise ValueError("rows carry no Triton layout: build them with tidegate.kernels.ops.lora_rows "
                         "where Triton serves (CUDA, or TIDEGATE_KERNELS=triton)")
    for name, t in (("x", x), ("y", y), ("a", stack.a), ("b", stack.b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    if x.shape[0]:
        h, ss = _shrink(x, stack, layout, norm)
        _expand(y, h, ss, stack, layout, x.shape[1], norm)


def _shrink(x: torch.Tensor, stack: LoraStack, layout: ExpertLayout, norm: Norm | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each K split's partial shrink [splits, T, S*R] and, with ``norm``, its partial sums of
    squares [splits, T] (else the first again, unused); float32."""
    tokens, k_dim = x.shape
    width = stack.a.shape[1]
    splits, k_per_split = shrink_splits(row_tiles(tokens), k_dim)
    h = torch.empty((splits, tokens, width), dtype=torch.float32, device=x.device)
    ss = h if norm is None else torch.empty((splits, tokens), dtype=torch.float32,
                                            device=x.device)
    block_r = min(MAX_SHRINK_R, max(MIN_DOT, triton.next_power_of_2(width)))
    grid = (layout.slots.numel() // layout.block_m, splits, triton.cdiv(width, block_r))
    _shrink_kernel[grid](
        x, x if norm is None else norm[0].contiguous(), stack.a, layout.slots,
        layout.block_expert, h, ss, tokens, k_dim, width, stack.num_adapters, k_per_split,
        x.stride(0), stack.a.stride(0), stack.a.stride(1), h.stride(0), h.stride(1),
        ss.stride(0), NORM=norm is not None, BLOCK_M=layout.block_m, BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=_precision(stack.a), num_warps=SHRINK_WARPS)
    return h, ss


def _expand(y: torch.Tensor, h: torch.Tensor, ss: torch.Tensor, stack: LoraStack,
            layout: ExpertLayout, k_dim: int, norm: Norm | None) -> None:
    """y += scale * (the summed partials, times 1/rms with ``norm``) @ b.T, per segment."""
    n_dim = y.shape[1]
    wide = layout.block_m == WIDE_BLOCK_M
    block_n, straddle = column_tile(stack.segments, WIDE_BLOCK_N if wide else MAX_BLOCK_N)
    starts = (*stack.segments, n_dim, n_dim)[:2]
    group_n = column_group(n_dim, stack.segments, block_n, straddle, row_tiles(y.shape[0]))
    grid = (layout.slots.numel() // layout.block_m, triton.cdiv(n_dim, group_n))
    _expand_kernel[grid](
        h, ss, stack.b, stack.scale, layout.slots, layout.block_expert, y, y.shape[0], n_dim,
        k_dim, stack.rank, stack.num_adapters, starts[0], starts[1],
        0.0 if norm is None else float(norm[1]), h.stride(0), h.stride(1), ss.stride(0),
        stack.b.stride(0), stack.b.stride(1), y.stride(0), NUM_SPLITS=h.shape[0],
        NUM_SEGMENTS=stack.num_segments, STRADDLE=straddle, NORM=norm is not None,
        BLOCK_M=layout.block_m, BLOCK_N=block_n, GROUP_N=group_n,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(stack.rank)),
        DOT_PRECISION=_precision(stack.b), num_warps=WIDE_WARPS if wide else EXPAND_WARPS)


def _precision(weights: torch.Tensor) -> str:
    """The dots' operands take the weights' dtype: float32 ones multiply exactly (the tests
    compare at 1e-5); 16-bit ones ignore the setting."""
    return "ieee" if weights.dtype == torch.float32 else "tf32"
