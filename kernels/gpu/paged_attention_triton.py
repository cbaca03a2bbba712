"""Triton attention over the paged KV cache: split-K decode, causal prefill over cached prefixes.

Owns the GPU side of ``tidegate.kernels.cpu.paged_attention`` (same layouts, same results as its plain-torch
references): ``paged_decode_attention_triton`` for the step's decodes (one query per sequence,
"flash decoding": the context is split across programs, then a small kernel combines the
splits), ``paged_prefill_attention_triton`` for its prefill chunks (query tiles that attend
causally to the cached prefix and the chunk itself), ``paged_attention_triton`` for a whole
step, and ``default_num_splits``, the decode kernel's split policy.

The decode path is CUDA-graph safe: its grid depends on tensor shapes and ``num_splits`` only,
never on the values of ``seq_lens``, and it reads nothing back to the host. The prefill path
builds a small tile table from the metadata's host lists (it is not graph-captured).

Both kernels read K/V in place through the block table, a tile of ``BLOCK_N`` positions (one
or several pages) at a time, with an online softmax in float32 (in base 2: ``exp2`` is the
hardware instruction, the scale folds ``log2(e)`` in).

Two model features ride along as compile-time switches, so a plain model's kernels are
unchanged: a sliding window (``window``: a query at position p sees keys p - window < k <= p;
the programs start at the window's first tile, so a windowed layer reads only its window) and
tanh soft-capping of the scores (``softcap``: s -> softcap * tanh(s / softcap), Gemma 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidegate.kernels.cpu.paged_attention import (
    PagedAttentionMetadata,
    check_cache_layout,
    check_shapes,
    upload,
)

# Keys per inner-loop step of the decode kernel, and the unit splits share the context in. On
# an H200 (bf16, Hq 32, Hk 8, D 128) 64 beat 32 at every batch (up to 1.7x for few long
# sequences: fewer dependent table -> K -> V load chains) and tied 128 at large batches.
DECODE_BLOCK_N = 64
# Query tokens per prefill program and keys per inner-loop step (the fused-attention tutorial's
# shapes: fine on Hopper for D up to 128 at 4 warps).
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
# tl.dot needs every dimension >= 16 (the interpreter and the tensor cores alike): the decode
# kernel pads its G query heads up to this many rows.
MIN_DOT_DIM = 16
# default_num_splits: how many programs to aim for per SM (a decode program is memory bound;
# one per SM leaves too few warps in flight to hide the latency of the page gathers), the least
# context worth a split of its own (below it the combine costs more than it saves) and a cap.
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16
DEFAULT_NUM_SMS = 132  # H100/H200 SXM
LOG2_E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The FP8 KV cache's element (``--kv-cache-dtype fp8``): e4m3, read with a scale of 1.
FP8_CACHE = torch.float8_e4m3fn


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table_ptr, kv_head_off, lo, hi, seq_len, qk_scale,
    window, softcap, stride_kb, stride_ks,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold key positions [lo, hi) (lo a multiple of BLOCK_N) into the running softmax of the
    query rows ``q`` at positions ``q_pos``. Unmasked: every position is < seq_len, <= every
    row's own position and inside every row's window, so loads and scores need no masks."""
    dims = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if MASKED:
            in_ctx = pos < seq_len
            # Past the context the table holds padding (block 0) and the cache NaN: never read
            # it, a masked score cannot hide a NaN value (NaN * 0 is NaN).
            page = tl.load(table_ptr + pos // PAGE_SIZE, mask=in_ctx, other=0)
        else:
            page = tl.load(table_ptr + pos // PAGE_SIZE)
        # int64: num_blocks * block_size * Hk * D passes 2**31 on a large cache.
        offs = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_ks + kv_head_off
        if MASKED:
            k = tl.load(k_ptr + offs[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + offs[:, None] + dims[None, :])
        # An FP8 cache's keys and values are widened to the dots' dtype (scale 1).
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if SOFTCAP:
            # softcap * tanh(scale * s / softcap), in log2 units; tanh(u) = 1 - 2 / (e^2u + 1)
            # stays finite for any u.
            u = s * (qk_scale / (1.4426950408889634 * softcap))
            s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        else:
            s = s * qk_scale
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
            if WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if MASKED:
            # A row that has seen no key yet and sees none here keeps m = -inf (a window's
            # first tile may hold none of a row's keys); only the exponents shift by a finite
            # stand-in (-inf - -inf is NaN). Keeping 0 as its running maximum would underflow
            # its real scores later when they are all far below 0.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptr + offs[:, None] + dims[None, :], mask=in_ctx[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + offs[:, None] + dims[None, :])
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# What moves from step to step is a runtime argument Triton does not specialize on, or the
# first step with a new value would compile the kernel anew mid-run (a second's stall at the
# start of a wave, every waiting job behind it): ``stride_tb``, the block table's width (the
# step's longest context), and ``num_splits``, which follows the step's batch and context (a
# constant, it compiled once per value: up to MAX_SPLITS times). Only whether there are
# several splits is a constant (SPLIT: the output written directly, or partials).
@triton.jit(do_not_specialize=["stride_tb", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, window, softcap,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
    num_splits,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP16: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One (sequence, kv head, split): the G query heads of the kv head over the split's share
    of the context. One split writes the output; several write a partial and its log2-sum-exp."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits share the context in whole tiles, per sequence: a short one leaves the last
    # splits empty rather than the grid depending on its length.
    # A window starts the context at its first tile; that tile is masked (its first keys are
    # outside), the rest up to the last whole tile are not.
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    first = 0
    if WINDOW:
        first = tl.maximum(seq_len - window, 0)
    tile0 = first // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - tile0, num_splits)
    lo = (tile0 + split * tiles_per_split) * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    head_hi = tl.minimum(tl.maximum((first + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
    head_hi = tl.maximum(head_hi, lo)
    full_hi = tl.maximum(tl.minimum(hi, seq_len // BLOCK_N * BLOCK_N), head_hi)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_FP16:  # an FP8 cache's dots in float16 (``_dots_in_fp16``)
        q = q.to(tl.float16)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_tb
    kv_head_off = kv_head * stride_kh
    if WINDOW:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_head_off, lo, head_hi, seq_len,
            qk_scale, window, softcap, stride_kb, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N,
            True, DOT_PRECISION, WINDOW, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_head_off, head_hi, full_hi, seq_len,
        qk_scale, window, softcap, stride_kb, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, False,
        DOT_PRECISION, WINDOW, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_head_off, full_hi, hi, seq_len,
        qk_scale, window, softcap, stride_kb, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, True,
        DOT_PRECISION, WINDOW, SOFTCAP)

    # An empty split (past the sequence's end, or a zero-length padding row of a captured
    # batch) has l = 0: it writes zeros and lse = -inf, which the combine weighs at 0.
    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not SPLIT:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (seq * NUM_Q_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One (sequence, query head): the splits' partials weighed by their share of the softmax
    (``num_splits`` <= SPLITS_PAD of them)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    split_ok = splits < num_splits
    base = (seq * NUM_Q_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: output 0, not NaN
    weight = tl.exp2(lse - top)
    part = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                   mask=split_ok[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_tb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, query_start_ptr, tiles_ptr,
    qk_scale, window, softcap,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FP16: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One (query tile, query head): up to BLOCK_M consecutive query tokens of one sequence
    against its context up to the tile's last position."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    tile_start = tl.load(tiles_ptr + 2 * tile + 1)  # first query row, within the sequence
    q_lo = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_lo
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tile_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    tokens = (q_lo + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_FP16:  # an FP8 cache's dots in float16 (``_dots_in_fp16``)
        q = q.to(tl.float16)
    first_pos = seq_len - q_len + tile_start
    q_pos = first_pos + tl.arange(0, BLOCK_M)
    # Keys before the tile's first query position are visible to every row: no masks there.
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    # A window: keys before the first row's window are nobody's; the unmasked run starts at
    # the last row's window, the tiles between are masked.
    lo = 0
    head_hi = 0
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        lo = tl.minimum(lo, full_hi)
        head_hi = tl.maximum(first_pos + BLOCK_M - window, 0)
        head_hi = tl.minimum(tl.maximum((head_hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo),
                             full_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_tb
    kv_head_off = (head // GROUP) * stride_kh
    if WINDOW:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_head_off, lo, head_hi, seq_len,
            qk_scale, window, softcap, stride_kb, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N,
            True, DOT_PRECISION, WINDOW, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_head_off, head_hi, full_hi, seq_len,
        qk_scale, window, softcap, stride_kb, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, False,
        DOT_PRECISION, WINDOW, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_head_off, full_hi, hi, seq_len,
        qk_scale, window, softcap, stride_kb, stride_ks, HEAD_DIM, PAGE_SIZE, BLOCK_N, True,
        DOT_PRECISION, WINDOW, SOFTCAP)
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def default_num_splits(
    max_context: int, batch: int, num_kv_heads: int, num_sms: int = DEFAULT_NUM_SMS
) -> int:
    """Splits per sequence for the decode kernel: enough (sequence, kv head, split) programs
    for ``PROGRAMS_PER_SM`` per SM, but no split shorter than ``MIN_TOKENS_PER_SPLIT`` of the
    longest context, and at most ``MAX_SPLITS``. A CUDA graph must capture with the split
    count it replays with: pass the longest context the graph will serve."""
    programs = batch * num_kv_heads
    if programs <= 0 or max_context <= MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = -(-num_sms * PROGRAMS_PER_SM // programs)
    worth = -(-max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, worth, MAX_SPLITS))


def paged_decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D]: one query per sequence, at position seq_lens[b] - 1
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32; 0 (a padding row) gives a zero output
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [B, Hq, D] in q's dtype, else a new tensor
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention for the batch -> [B, Hq, D], launched without reading ``seq_lens``.

    ``partials``: scratch for the splits, ``([B, Hq, num_splits, D], [B, Hq, num_splits])``
    float32 contiguous, else allocated here; a graph runner may keep its own across replays.
    """
    _check_common(q, key_cache, value_cache)
    b, hq, d = q.shape
    _check_table(block_tables, "block_tables", 2, q.device)
    _check_table(seq_lens, "seq_lens", 1, q.device)
    if block_tables.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(f"q has {b} sequences, block_tables {block_tables.shape[0]} rows and "
                         f"seq_lens {seq_lens.shape[0]}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    out = _check_out(out, q)
    if b == 0:
        return out
    hk = key_cache.shape[2]
    group = hq // hk
    if num_splits > 1:
        shape = (b, hq, num_splits)
        if partials is None:
            partials = (torch.empty(*shape, d, dtype=torch.float32, device=q.device),
                        torch.empty(shape, dtype=torch.float32, device=q.device))
        part_out, part_lse = partials
        for t, want in ((part_out, (*shape, d)), (part_lse, shape)):
            if t.shape != want or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"partials must be float32 contiguous {want}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
    else:
        part_out = part_lse = out  # unused: one split writes the output itself
    _decode_split_kernel[(b, hk, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2_E, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), num_splits,
        NUM_Q_HEADS=hq, GROUP=group, GROUP_PAD=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        HEAD_DIM=d, PAGE_SIZE=key_cache.shape[1], BLOCK_N=DECODE_BLOCK_N,
        SPLIT=num_splits > 1, DOT_PRECISION=_dot_precision(q.dtype),
        DOT_FP16=_dots_in_fp16(q, key_cache), WINDOW=window is not None,
        SOFTCAP=softcap is not None, num_warps=4,
    )
    if num_splits > 1:
        _decode_combine_kernel[(b, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            NUM_Q_HEADS=hq, HEAD_DIM=d,
            SPLITS_PAD=triton.next_power_of_2(max(num_splits, MAX_SPLITS)), num_warps=4,
        )
    return out


def paged_prefill_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]: the whole step, decodes included
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] in q's dtype
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for the step's prefill chunks (the sequences after ``meta.num_decodes``),
    written into their rows of ``out``; the decodes' rows are left as they are."""
    _check_step(q, key_cache, value_cache, meta)
    out = _check_out(out, q)
    tiles = prefill_tiles(meta, PREFILL_BLOCK_M)
    if not tiles:
        return out
    tile_table = upload(tiles, torch.int32, q.device)
    hq, d = q.shape[1:]
    _prefill_kernel[(len(tiles), hq)](
        q, key_cache, value_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        tile_table, scale * LOG2_E, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], meta.block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // key_cache.shape[2], HEAD_DIM=d, PAGE_SIZE=key_cache.shape[1],
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=_dot_precision(q.dtype),
        DOT_FP16=_dots_in_fp16(q, key_cache), WINDOW=window is not None,
        SOFTCAP=softcap is not None, num_warps=4,
    )
    return out


def prefill_tiles(meta: PagedAttentionMetadata, block_m: int) -> list[tuple[int, int]]:
    """(sequence, first query row) of each prefill tile; no tile straddles two sequences.
    Longest context first, so the programs that run longest start in the first wave."""
    nd = meta.num_decodes
    lens = zip(meta.seq_lens_host[nd:], meta.query_lens_host[nd:], strict=True)
    tiles = [
        (seq_len - q_len + start + block_m, nd + i, start)
        for i, (seq_len, q_len) in enumerate(lens) for start in range(0, q_len, block_m)
    ]
    tiles.sort(key=lambda t: -t[0])
    return [(seq, start) for _, seq, start in tiles]


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D] in q's dtype, else a new tensor
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The step's attention, as ``tidegate.kernels.cpu.paged_attention.paged_attention`` -> [T, Hq, D]:
    decodes through the split-K kernel, prefill chunks through the tiled one."""
    _check_step(q, key_cache, value_cache, meta)
    out = _check_out(out, q)
    nd = meta.num_decodes
    if nd:
        num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
                   if q.is_cuda else DEFAULT_NUM_SMS)
        context = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
        splits = default_num_splits(context, nd, key_cache.shape[2], num_sms)
        paged_decode_attention_triton(
            q[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            splits, out=out[:nd], window=window, softcap=softcap,
        )
    if nd < len(meta.seq_lens_host):
        paged_prefill_attention_triton(q, key_cache, value_cache, meta, scale, out,
                                       window=window, softcap=softcap)
    return out


def _dots_in_fp16(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the dots take bfloat16 queries as float16: with an FP8 cache. e4m3 widens to
    float16 in one instruction per two values (cvt.rn.f16x2.e4m3x2) but to bfloat16 through
    float32, which made the FP8 cache's decode slower than the bfloat16 cache's at a thousand
    rows. float16 has 3 more mantissa bits; a query past 65504 would not fit, far beyond what
    attention's inputs reach."""
    return key_cache.dtype == FP8_CACHE and q.dtype == torch.bfloat16


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through TF32 tensor cores (~1e-3 relative error);
    # for 16-bit inputs the option is ignored.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_common(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    check_cache_layout(q, key_cache, value_cache)
    d = key_cache.shape[3]
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if key_cache.dtype not in (q.dtype, FP8_CACHE) or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"caches must have q's dtype {q.dtype} (or both be float8_e4m3fn), "
                         f"got {key_cache.dtype} and {value_cache.dtype}")
    if d < MIN_DOT_DIM or d & (d - 1):
        raise ValueError(f"head dim must be a power of two >= {MIN_DOT_DIM}, got {d}")
    if q.stride(2) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {q.stride()}")
    if key_cache.device != q.device or value_cache.device != q.device:
        raise ValueError(f"caches must be on q's device {q.device}, got {key_cache.device} and "
                         f"{value_cache.device}")


def _check_table(t: torch.Tensor, name: str, dim: int, device: torch.device) -> None:
    if t.dim() != dim or t.dtype != torch.int32 or t.device != device:
        raise ValueError(f"{name} must be a {dim}-D int32 tensor on {device}, got "
                         f"{t.dim()}-D {t.dtype} on {t.device}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {t.stride()}")


def _check_step(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: PagedAttentionMetadata) -> None:
    _check_common(q, key_cache, value_cache)
    check_shapes(q, key_cache, value_cache, meta)
    _check_table(meta.block_tables, "block_tables", 2, q.device)
    _check_table(meta.seq_lens, "seq_lens", 1, q.device)
    _check_table(meta.query_start_loc, "query_start_loc", 1, q.device)
    width = meta.block_tables.shape[1] * key_cache.shape[1]
    if meta.max_seq_len > width:
        raise ValueError(f"block_tables cover {width} positions, the longest context is "
                         f"{meta.max_seq_len}")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out.stride(2) != 1:
        raise ValueError(f"out's last dim must be contiguous, got strides {out.stride()}")
    return out


__all__ = [
    "default_num_splits",
    "paged_attention_triton",
    "paged_decode_attention_triton",
    "paged_prefill_attention_triton",
    "prefill_tiles",
]
