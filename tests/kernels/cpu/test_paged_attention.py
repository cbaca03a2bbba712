"""Paged attention against its reference and against dense float64 attention on un-paged data.

Every batch lives in shuffled, non-contiguous blocks; block 0 (the block-table padding), unused
blocks and the unwritten tail of each last block hold NaN, so a single stray read fails a test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.paged_attention import (
    PagedAttentionMetadata,
    paged_attention_ref,
    paged_decode_attention,
)

# (seq_len, query_len) per sequence, decodes first. Prefill chunks: no cached prefix, a cached
# prefix that ends mid-block, a chunk that starts mid-block; seq_len 1 and exact block multiples.
MIXED = [(37, 1), (1, 1), (32, 1), (70, 1), (40, 1), (23, 23), (50, 13), (45, 7), (9, 9)]
DECODES = [(37, 1), (1, 1), (32, 1), (70, 1), (40, 1), (130, 1)]
PREFILLS = [(23, 23), (50, 13), (45, 7)]
SHARED_TOKENS = 32  # sequences 4 and 7 of MIXED share the blocks of their first 32 tokens
GQA = [(4, 4), (9, 3), (8, 2)]  # (Hq, Hk): group sizes 1, 3, 4


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: PagedAttentionMetadata
    scale: float
    expected: torch.Tensor  # [T, Hq, D] float64, dense causal attention on un-paged k/v


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, Hq, D] for the last Lq of the n positions of k/v [n, Hk, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0])
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_batch(
    seqs: list[tuple[int, int]], *, hq: int, hk: int, d: int, block_size: int,
    dtype: torch.dtype, share: tuple[int, int] | None = None, seed: int = 0,
) -> Batch:
    """Write each sequence's cached prefix straight into its blocks, store the step's k/v
    through ``ops.store_kv``; ``share=(a, b)``: b's first blocks are a's (same tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ks = [torch.randn(n, hk, d, generator=gen).to(dtype) for n, _ in seqs]
    vs = [torch.randn(n, hk, d, generator=gen).to(dtype) for n, _ in seqs]
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 5
    free = list(range(1, num_blocks))  # block 0 stays NaN: it is what padding points at
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n, _ in seqs]
    if share is not None:
        a, b = share
        shared = SHARED_TOKENS // block_size
        tables[b][:shared] = tables[a][:shared]
        ks[b][:SHARED_TOKENS], vs[b][:SHARED_TOKENS] = ks[a][:SHARED_TOKENS], vs[a][:SHARED_TOKENS]

    key_cache = torch.full((num_blocks, block_size, hk, d), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))

    def slots(table: list[int], positions: range) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in positions]

    for (n, q_len), table, k, v in zip(seqs, tables, ks, vs, strict=True):
        cached = torch.tensor(slots(table, range(n - q_len)), dtype=torch.long)
        key_cache.view(-1, hk, d)[cached] = k[: n - q_len]
        value_cache.view(-1, hk, d)[cached] = v[: n - q_len]
    slot_mapping = [
        s for (n, q), t in zip(seqs, tables, strict=True) for s in slots(t, range(n - q, n))
    ]
    step_k = torch.cat([k[n - q :] for (n, q), k in zip(seqs, ks, strict=True)])
    step_v = torch.cat([v[n - q :] for (n, q), v in zip(seqs, vs, strict=True)])
    meta = PagedAttentionMetadata.build(
        tables, [n for n, _ in seqs], [q for _, q in seqs], slot_mapping
    )
    ops.store_kv(step_k, step_v, key_cache, value_cache, meta.slot_mapping)

    q = torch.randn(meta.num_tokens, hq, d, generator=gen).to(dtype)
    scale = d**-0.5
    starts = meta.query_start_loc_host
    expected = torch.cat([
        dense_attention(q[starts[i] : starts[i + 1]], k, v, scale)
        for i, (k, v) in enumerate(zip(ks, vs, strict=True))
    ])
    return Batch(q, key_cache, value_cache, meta, scale, expected)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("d", "block_size"), [(64, 16), (16, 4), (64, 4), (16, 16)])
@pytest.mark.parametrize(("hq", "hk"), GQA)
def test_mixed_batch_matches_reference_and_dense_attention(
    hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype, mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", mode)  # auto: float32 decodes go native
    b = make_batch(MIXED, hq=hq, hk=hk, d=d, block_size=block_size, dtype=dtype, share=(4, 7))
    assert b.meta.num_decodes == 5
    out = ops.paged_attention(b.q, b.key_cache, b.value_cache, b.meta, b.scale)
    ref = paged_attention_ref(b.q, b.key_cache, b.value_cache, b.meta, b.scale)
    assert_close(ref, b.expected, dtype)
    assert_close(out, b.expected, dtype)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hq", "hk"), GQA)
def test_decode_path_ignores_padded_block_table_entries(
    hq: int, hk: int, dtype: torch.dtype
) -> None:
    # The full-width table: short rows are padded with block 0, which is all NaN.
    b = make_batch(DECODES, hq=hq, hk=hk, d=64, block_size=16, dtype=dtype, seed=1)
    meta = b.meta
    assert meta.num_decodes == len(DECODES) and (meta.block_tables == 0).any()
    out = paged_decode_attention(
        b.q, b.key_cache, b.value_cache, meta.block_tables, meta.seq_lens, b.scale
    )
    assert_close(out, b.expected, dtype)
    assert_close(out, paged_attention_ref(b.q, b.key_cache, b.value_cache, meta, b.scale), dtype)
    assert_close(ops.paged_attention(b.q, b.key_cache, b.value_cache, meta, b.scale),
                 b.expected, dtype)


@pytest.mark.parametrize("block_size", [16, 4])
def test_prefill_only_batch_matches_dense_attention(block_size: int) -> None:
    b = make_batch(PREFILLS, hq=9, hk=3, d=16, block_size=block_size, dtype=torch.float32)
    assert b.meta.num_decodes == 0
    out = ops.paged_attention(b.q, b.key_cache, b.value_cache, b.meta, b.scale)
    assert_close(out, b.expected, torch.float32)


def test_store_kv_writes_exactly_the_given_slots_and_skips_negative_ones() -> None:
    key_cache = torch.full((6, 4, 2, 8), -7.0)
    value_cache = torch.full((6, 4, 2, 8), -7.0)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slot_mapping = torch.tensor([13, -1, 2, 23, -1])  # -1 must not land in the last slot
    ops.store_kv(key, value, key_cache, value_cache, slot_mapping)
    for cache, src in ((key_cache, key), (value_cache, value)):
        flat = cache.view(-1, 2, 8)
        assert torch.equal(flat[[13, 2, 23]], src[[0, 2, 3]])
        untouched = torch.ones(24, dtype=torch.bool)
        untouched[[13, 2, 23]] = False
        assert (flat[untouched] == -7.0).all()


def test_metadata_build_pads_tables_and_counts_leading_decodes() -> None:
    meta = PagedAttentionMetadata.build(
        [[3], [5, 1, 4], [2, 6]], seq_lens=[3, 40, 20], query_lens=[1, 1, 8],
        slot_mapping=[50, 73, 100, 101, 102, 103, 104, 105, 106, 107],
    )
    assert meta.block_tables.tolist() == [[3, 0, 0], [5, 1, 4], [2, 6, 0]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 1, 2, 10]
    assert (meta.num_decodes, meta.max_seq_len, meta.num_tokens) == (2, 40, 10)


def test_metadata_rejects_a_query_longer_than_its_context() -> None:
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        PagedAttentionMetadata.build([[0]], seq_lens=[3], query_lens=[4], slot_mapping=[0] * 4)


def test_paged_attention_names_a_token_count_mismatch() -> None:
    b = make_batch(DECODES, hq=4, hk=4, d=16, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="tokens"):
        ops.paged_attention(b.q[1:], b.key_cache, b.value_cache, b.meta, b.scale)


@pytest.mark.parametrize(("hq", "hk"), [(9, 3), (4, 4)])
def test_many_decodes_are_bucketed_by_length_and_still_exact(
    hq: int, hk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "reference")  # buckets serve the torch path
    rng = random.Random(7)
    # 37 decodes of very different lengths (so 4 length buckets), then two prefill chunks.
    seqs = [(rng.randint(1, 200), 1) for _ in range(37)] + [(30, 30), (60, 11)]
    batch = make_batch(seqs, hq=hq, hk=hk, d=16, block_size=4, dtype=torch.float32, seed=3)
    buckets = batch.meta.decode_buckets
    assert len(buckets) == 4 and sorted(i for rows, _ in buckets for i in rows.tolist()) == list(
        range(37))
    assert [longest for _, longest in buckets] == sorted(longest for _, longest in buckets)
    out = ops.paged_attention(batch.q, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert torch.isfinite(out).all()
    assert_close(out, batch.expected, torch.float32)
    ref = paged_attention_ref(batch.q, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert_close(out, ref.double(), torch.float32)


def test_block_tables_pad_to_the_widest_with_block_zero() -> None:
    from tidegate.kernels.cpu.paged_attention import padded_tables

    tables = padded_tables([[7, 3], [], [9, 8, 6, 5]])
    assert tables.dtype == torch.int32
    assert tables.tolist() == [[7, 3, 0, 0], [0, 0, 0, 0], [9, 8, 6, 5]]
    assert padded_tables([]).shape == (0, 0)
