"""Attention over the paged KV cache: store this step's keys and values, then attend.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, Hk, D]``; slot
``block_id * block_size + offset`` is one token. On the CPU the cache may hold 8-bit heads
(``--kv-cache-dtype int8``): int8 ``[num_blocks, block_size, Hk, D + 4]``, each head's D values
rounded to ``x / s`` with ``s = max|x| / 127`` and the float32 ``s`` in its last 4 bytes
(``quantize_kv_ref``), written and read only by the native kernels. A step's batch is flat (``[T, ...]`` tokens of
many sequences, decodes first) and described by ``PagedAttentionMetadata``: plain tensors a
Triton kernel can take as they are, plus host copies of the lengths so torch loops never sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from tidegate.kernels.cpu.native_cpu import native_decode_applies, native_kernels


@dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """Describes one step's flat batch over the paged cache.

    Query token i of sequence s sits at position ``seq_lens[s] - query_len[s] + i`` and attends
    to every context position up to its own: cached prefix blocks (earlier steps, or shared by
    prefix caching) and this step's keys, which are stored before attention.
    """

    # [T] int64: cache slot (block_id * block_size + offset) of each token; < 0 skips the token.
    slot_mapping: torch.Tensor
    # [B, max_blocks] int32: each sequence's blocks in position order, rows padded with 0.
    block_tables: torch.Tensor
    # [B] int32: tokens in each sequence's context once this step's tokens are stored.
    seq_lens: torch.Tensor
    # [B + 1] int32: where each sequence's query tokens start in the flat batch (cumulative).
    query_start_loc: torch.Tensor
    # The first num_decodes sequences have exactly one query token; the rest are prefill chunks.
    num_decodes: int
    # max(seq_lens), 0 for an empty batch.
    max_seq_len: int
    # Host copies of seq_lens and of the query lengths, so loops need no device sync.
    seq_lens_host: list[int]
    query_lens_host: list[int]
    # Decode rows grouped by context length, each group with its longest context:
    # padding every decode to the longest context wastes much of the gather and SDPA work
    # when lengths differ. Empty: one group of all decodes (see ``decode_groups``).
    decode_buckets: tuple[tuple[torch.Tensor, int], ...] = ()

    def __post_init__(self) -> None:
        lens = zip(self.seq_lens_host, self.query_lens_host, strict=True)
        if any(not 0 < q <= s for s, q in lens):
            raise ValueError("each sequence needs 0 < query_len <= seq_len")
        if any(q != 1 for q in self.query_lens_host[: self.num_decodes]):
            raise ValueError("the first num_decodes sequences must have one query token each")

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    @property
    def query_start_loc_host(self) -> list[int]:
        return [0, *accumulate(self.query_lens_host)]

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        slot_mapping: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> PagedAttentionMetadata:
        """From host lists; num_decodes counts the leading sequences with one query token."""
        tables = to_device(padded_tables(block_tables), device)
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        return cls(
            slot_mapping=upload(slot_mapping, torch.int64, device),
            block_tables=tables,
            seq_lens=upload(seq_lens, torch.int32, device),
            query_start_loc=upload([0, *accumulate(query_lens)], torch.int32, device),
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens, default=0),
            seq_lens_host=list(seq_lens),
            query_lens_host=list(query_lens),
            # Only the torch path on the CPU reads them (the CUDA kernels take any lengths).
            decode_buckets=(decode_buckets(list(seq_lens[:num_decodes]), device)
                            if torch.device(device).type == "cpu" else ()),
        )


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """A step over one layer's paged cache: what a whole-layer kernel needs besides the layer's
    weights (``tidegate.kernels.cpu.decoder_layer``)."""

    key_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor
    meta: PagedAttentionMetadata
    scale: float


@dataclass(frozen=True, slots=True)
class PagedStack:
    """A step over every layer's paged cache at once: what the layer-stack kernel needs
    besides the layers' weights (``tidegate.kernels.cpu.decoder_layer``)."""

    kv_cache: torch.Tensor  # [L, 2, num_blocks, block_size, Hk, D]
    meta: PagedAttentionMetadata
    scale: float

    def layer(self, layer: int) -> PagedLayer:
        return PagedLayer(self.kv_cache[layer, 0], self.kv_cache[layer, 1], self.meta,
                          self.scale)


def upload(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host values on ``device`` (``to_device``)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``. On a GPU it goes up from pinned memory without blocking: a
    plain copy would wait for every step already queued, and a step queued ahead of its
    predecessor's end is what keeps the GPU busy."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def padded_tables(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """The block tables as one int32 host tensor [n, widest], each row padded with block 0
    (columns past a sequence's own blocks are never read: its length bounds them). Row by row
    into a NumPy array: for 1000 sequences of ~24 blocks a nested list through torch.tensor
    took 4.2 ms a step, this 0.7."""
    width = max((len(t) for t in block_tables), default=0)
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, table in zip(out, block_tables, strict=True):
        row[: len(table)] = table
    return torch.from_numpy(out)


MIN_DECODES_PER_BUCKET = 8
MAX_DECODE_BUCKETS = 4


def decode_buckets(lens: list[int], device: torch.device | str
                   ) -> tuple[tuple[torch.Tensor, int], ...]:
    """Split decodes, sorted by context length, into up to 4 groups of at least 8, each with
    its longest context. A single group is () (no reordering needed)."""
    groups = min(MAX_DECODE_BUCKETS, len(lens) // MIN_DECODES_PER_BUCKET)
    if groups <= 1:
        return ()
    order = sorted(range(len(lens)), key=lens.__getitem__)
    size = -(-len(order) // groups)
    return tuple(
        (torch.tensor(rows, dtype=torch.long, device=device), max(lens[i] for i in rows))
        for rows in (order[i : i + size] for i in range(0, len(order), size))
    )


def kv_int8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds 8-bit heads (the CPU's int8 cache) rather than floats."""
    return cache.dtype == torch.int8


def quantize_kv_ref(x: torch.Tensor) -> torch.Tensor:
    """Heads x [..., D] float32 as the int8 cache stores them: [..., D + 4] int8."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = amax * (torch.tensor(1.0) / torch.tensor(127.0))
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    q = torch.round(x * inv).to(torch.int8)
    return torch.cat([q, s.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_ref(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache [..., D + 4] as the floats it stands for, [..., D] float32."""
    scale = cache[..., -4:].contiguous().view(torch.float32)
    return cache[..., :-4].float() * scale


def _float_only(cache: torch.Tensor) -> None:
    if kv_int8(cache):
        raise ValueError("an int8 KV cache is read and written by the native CPU kernels only "
                         "(TIDEGATE_KERNELS auto or native, float32 on the CPU)")


def store_kv_ref(
    key: torch.Tensor,  # [T, Hk, D]
    value: torch.Tensor,  # [T, Hk, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write each token's key and value into its slot, in place; slots < 0 are padding."""
    _float_only(key_cache)
    keep = slot_mapping >= 0  # boolean indexing syncs on a GPU; the Triton kernel won't
    slots = slot_mapping[keep]
    for src, cache in ((key, key_cache), (value, value_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src[keep].to(cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The obviously-correct version: per sequence, gather by position, float32, causal;
    ``window``: a query at p sees keys p - window < k <= p; ``softcap``: scores s ->
    softcap * tanh(s / softcap)."""
    out = torch.empty_like(q)
    block_size, group = key_cache.shape[1], q.shape[1] // key_cache.shape[2]
    starts = meta.query_start_loc_host
    lens = zip(meta.seq_lens_host, meta.query_lens_host, strict=True)

    def read(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        heads = cache[blocks, offsets]
        heads = dequantize_kv_ref(heads) if kv_int8(cache) else heads.float()
        return heads.repeat_interleave(group, dim=1)

    for s, (seq_len, q_len) in enumerate(lens):
        pos = torch.arange(seq_len, device=q.device)
        blocks = meta.block_tables[s].long()[pos // block_size]
        k = read(key_cache, blocks, pos % block_size)
        v = read(value_cache, blocks, pos % block_size)
        rows = slice(starts[s], starts[s] + q_len)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = pos[seq_len - q_len :, None]
        hidden = pos[None, :] > q_pos
        if window is not None:
            hidden |= pos[None, :] <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one query per sequence, at position seq_lens[b] - 1
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32; W * block_size must cover the longest sequence
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention for the whole batch at once: one gather, one SDPA -> [B, Hq, D]
    (explicit scores where ``softcap`` is set: SDPA has no soft-capping)."""
    b, _, d = q.shape
    _, block_size, hk, _ = key_cache.shape
    ctx = block_tables.shape[1] * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * block_size + offsets).view(b, ctx)
    valid = torch.arange(ctx, device=q.device) < seq_lens[:, None]  # [B, ctx]
    if window is not None:
        valid &= torch.arange(ctx, device=q.device) >= seq_lens[:, None] - window
    # Positions past seq_len read the sequence's first slot, which is always written: a mask
    # cannot hide an unwritten slot's NaN (NaN * 0 is NaN), a finite value it can.
    slots = torch.where(valid, slots, slots[:, :1]).view(-1)
    k = key_cache.view(-1, hk, d).index_select(0, slots).view(b, ctx, hk, d)
    v = value_cache.view(-1, hk, d).index_select(0, slots).view(b, ctx, hk, d)
    if softcap is not None:
        scores = torch.einsum("bhgd,bchd->bhgc", q.reshape(b, hk, -1, d).float(), k.float())
        scores = torch.tanh(scores * scale / softcap) * softcap
        scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
        out = torch.einsum("bhgc,bchd->bhgd", scores.softmax(-1), v.float())
        return out.reshape(q.shape).to(q.dtype)
    # GQA as heads-in-groups: kv head h serves query heads h*G .. h*G+G-1, as G queries sharing
    # one mask. On CPU ~20% faster than enable_gqa in float32 (the CPU default), ~15% slower
    # in bfloat16.
    out = F.scaled_dot_product_attention(
        q.reshape(b, hk, -1, d), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid[:, None, None], scale=scale,
    )  # [B, Hk, G, D]
    return out.reshape(q.shape)


def paged_prefill_attention(
    q: torch.Tensor,  # [Tp, Hq, D]: the chunks' query tokens, one sequence after another
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [P, W] int32, one row per chunk
    seq_lens_host: Sequence[int],
    query_lens_host: Sequence[int],
    scale: float,
    out: torch.Tensor | None = None,  # [Tp, Hq, D] to write into, else a new tensor
) -> torch.Tensor:
    """Prefill chunks, one SDPA per sequence over its gathered context -> [Tp, Hq, D]."""
    out = torch.empty_like(q) if out is None else out
    block_size, hk, d = key_cache.shape[1:]
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(seq_lens_host, query_lens_host, strict=True)):
        blocks = block_tables[row, : -(-seq_len // block_size)]
        k = key_cache.index_select(0, blocks).view(-1, hk, d)[:seq_len]
        v = value_cache.index_select(0, blocks).view(-1, hk, d)[:seq_len]
        mask = None
        if seq_len > q_len:  # a cached prefix: query i sees the prefix and new keys up to i
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
            mask = mask.tril(seq_len - q_len)
        rows = slice(start, start + q_len)
        # 4-D inputs: with 3-D ones the CPU dispatcher takes the math path (2-3x slower here).
        out[rows] = F.scaled_dot_product_attention(
            q[None, rows].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1)
        start += q_len
    return out


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The step's attention: decodes batched, prefill chunks per sequence -> [T, Hq, D].

    Decodes in float32 on the CPU go to the native kernel, which reads the cache in place,
    and so do prompt chunks, row by row with the decodes' arithmetic (a token's attention then
    does not depend on whether a decode or a prompt chunk computed it); elsewhere (and with
    ``TIDEGATE_KERNELS=reference``) to the gather + SDPA paths below. A sliding window or
    soft-capped scores (Mistral, Gemma) go to ``paged_attention_ref`` on the CPU.
    """
    check_shapes(q, key_cache, value_cache, meta)
    if window is not None or softcap is not None:
        return paged_attention_ref(q, key_cache, value_cache, meta, scale, window, softcap)
    if not native_decode_applies(q):
        _float_only(key_cache)
    nd, block_size = meta.num_decodes, key_cache.shape[1]
    decode = None
    native = native_kernels() if nd and native_decode_applies(q) else None
    if nd and meta.decode_buckets and native is None:
        decode = torch.empty_like(q[:nd])
        for rows, longest in meta.decode_buckets:
            width = -(-longest // block_size)
            decode[rows] = paged_decode_attention(
                q[rows], key_cache, value_cache, meta.block_tables[rows, :width],
                meta.seq_lens[rows], scale,
            )
    elif nd:
        # One call for all decodes, the table trimmed to the longest context; the native
        # kernel reads only each sequence's own blocks, so it needs no length buckets.
        attend = native.paged_decode if native is not None else paged_decode_attention
        width = -(-max(meta.seq_lens_host[:nd]) // block_size)
        decode = attend(q[:nd], key_cache, value_cache, meta.block_tables[:nd, :width],
                        meta.seq_lens[:nd], scale)
        if nd == len(meta.seq_lens_host):
            return decode
    out = torch.empty_like(q)
    if decode is not None:
        out[:nd] = decode
    if native_decode_applies(q):  # float32 CPU: each row as a decode computes it
        native = native_kernels()
        assert native is not None
        start = nd
        for row in range(nd, len(meta.seq_lens_host)):
            seq_len, q_len = meta.seq_lens_host[row], meta.query_lens_host[row]
            native.paged_prefill(q[start:start + q_len], key_cache, value_cache,
                                 meta.block_tables[row], seq_len - q_len, scale,
                                 out[start:start + q_len])
            start += q_len
        return out
    paged_prefill_attention(
        q[nd:], key_cache, value_cache, meta.block_tables[nd:], meta.seq_lens_host[nd:],
        meta.query_lens_host[nd:], scale, out=out[nd:],
    )
    return out


def check_shapes(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
) -> None:
    """Raise ValueError naming the mismatch; cheap (no device sync)."""
    check_cache_layout(q, key_cache, value_cache)
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, the metadata {meta.num_tokens}")


def check_cache_layout(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
                       ) -> None:
    """q [T, Hq, D] against caches [blocks, block_size, Hk, D] (int8: D + 4): ValueError naming
    the problem."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must both be [blocks, block_size, Hk, D], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    hk, d = key_cache.shape[2:]
    d -= 4 if kv_int8(key_cache) else 0  # 8-bit heads end with their scale
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hk:
        raise ValueError(f"q must be [T, Hq, {d}] with Hq a multiple of {hk}, "
                         f"got {tuple(q.shape)}")
