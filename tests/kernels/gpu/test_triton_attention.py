"""The Triton paged attention kernels against dense float64 attention and ``paged_attention_ref``.

Batches come from ``make_batch`` (shuffled blocks; padding, unused blocks and unwritten tails
hold NaN, so a stray read fails). Every output and every scratch buffer the wrappers allocate
starts as NaN, so an element a kernel fails to write fails too. Without CUDA the kernels run in
Triton's interpreter, which is slow: contexts stay at or under 200 tokens and heads few.
float32 and float16 only (the interpreter's bfloat16 tl.dot is wrong; ``tests/gpu`` has it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import tidegate.kernels.gpu.paged_attention_triton as pat
from tests.kernels.cpu.test_paged_attention import GQA, MIXED, Batch, assert_close, make_batch
from tidegate.kernels import ops
from tidegate.kernels.cpu.paged_attention import PagedAttentionMetadata, paged_attention_ref
from tidegate.kernels.gpu.paged_attention_triton import (
    default_num_splits,
    paged_attention_triton,
    paged_decode_attention_triton,
    paged_prefill_attention_triton,
    prefill_tiles,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One token, exact block (16) and decode-tile (64) boundaries, mid-block, and contexts spanning
# several splits (200 tokens: 4 tiles of 64, so 8 splits leave 4 empty).
DECODES = [(1, 1), (16, 1), (64, 1), (37, 1), (130, 1), (200, 1)]
# No cached prefix, a prefix ending mid-block, a chunk starting mid-block, one token, a chunk of
# three query tiles (150 tokens) after a cached prefix, a chunk exactly one tile long.
PREFILLS = [(23, 23), (50, 13), (45, 7), (9, 1), (200, 150), (64, 64)]


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Floating-point ``torch.empty`` tensors start as NaN while the test runs (after the
    batch is built: ``make_batch`` is called inside the tests)."""
    empty = torch.empty

    def nan_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    yield


def batch_on_device(seqs: list[tuple[int, int]], **kwargs: object) -> Batch:
    b = make_batch(seqs, **kwargs)  # type: ignore[arg-type]
    m = b.meta
    meta = dataclasses.replace(
        m, slot_mapping=m.slot_mapping.to(DEVICE), block_tables=m.block_tables.to(DEVICE),
        seq_lens=m.seq_lens.to(DEVICE), query_start_loc=m.query_start_loc.to(DEVICE),
        decode_buckets=(),
    )
    return Batch(b.q.to(DEVICE), b.key_cache.to(DEVICE), b.value_cache.to(DEVICE), meta,
                 b.scale, b.expected)


def reference(b: Batch) -> torch.Tensor:
    """``paged_attention_ref`` in float32 on the batch's (possibly float16) values."""
    return paged_attention_ref(b.q.float(), b.key_cache.float(), b.value_cache.float(), b.meta,
                               b.scale)


def check(out: torch.Tensor, b: Batch, rows: slice = slice(None)) -> None:
    dtype = b.q.dtype
    assert_close(out[rows].cpu(), b.expected[rows], dtype)
    assert_close(out[rows].cpu(), reference(b)[rows].cpu().to(dtype), dtype)


def decode(b: Batch, num_splits: int) -> torch.Tensor:
    m = b.meta
    return paged_decode_attention_triton(b.q, b.key_cache, b.value_cache, m.block_tables,
                                         m.seq_lens, b.scale, num_splits)


@pytest.mark.parametrize(("hq", "hk"), GQA)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_matches_reference(num_splits: int, hq: int, hk: int) -> None:
    b = batch_on_device(DECODES, hq=hq, hk=hk, d=32, block_size=16, dtype=torch.float32)
    assert (b.meta.block_tables == 0).any()  # short rows' padding points at all-NaN block 0
    check(decode(b, num_splits), b)


@pytest.mark.parametrize(
    ("d", "dtype", "block_size"),
    [(16, torch.float32, 1), (32, torch.float16, 4), (64, torch.float32, 32),
     (64, torch.float16, 16)],
    ids=["d16-fp32-page1", "d32-fp16-page4", "d64-fp32-page32", "d64-fp16-page16"],
)
def test_decode_head_dims_dtypes_and_page_sizes(d: int, dtype: torch.dtype,
                                                block_size: int) -> None:
    b = batch_on_device(DECODES, hq=8, hk=2, d=d, block_size=block_size, dtype=dtype, seed=2)
    check(decode(b, 3), b)


def test_decode_into_given_buffers_and_zero_length_padding_rows() -> None:
    # A captured batch pads with rows of seq_len 0: they must come out as zeros, not NaN, and
    # leave the other rows alone; a runner may hand in its own output and scratch.
    b = batch_on_device(DECODES, hq=4, hk=4, d=16, block_size=4, dtype=torch.float32, seed=4)
    m, n, splits = b.meta, len(DECODES), 3
    seq_lens = m.seq_lens.clone()
    seq_lens[1] = 0
    out = torch.full_like(b.q, float("nan"))
    partials = (torch.full((n, 4, splits, 16), float("nan"), device=DEVICE),
                torch.full((n, 4, splits), float("nan"), device=DEVICE))
    got = paged_decode_attention_triton(b.q, b.key_cache, b.value_cache, m.block_tables,
                                        seq_lens, b.scale, splits, out=out, partials=partials)
    assert got is out
    assert (out[1] == 0).all()
    keep = [i for i in range(n) if i != 1]
    assert_close(out[keep].cpu(), b.expected[keep], torch.float32)


@pytest.mark.parametrize(("hq", "hk", "block_size", "dtype"), [
    (9, 3, 16, torch.float32), (4, 4, 4, torch.float32), (8, 2, 32, torch.float16),
])
def test_prefill_only_with_and_without_cached_prefixes(hq: int, hk: int, block_size: int,
                                                       dtype: torch.dtype) -> None:
    b = batch_on_device(PREFILLS, hq=hq, hk=hk, d=32, block_size=block_size, dtype=dtype,
                        seed=5)
    assert b.meta.num_decodes == 0
    out = paged_prefill_attention_triton(b.q, b.key_cache, b.value_cache, b.meta, b.scale,
                                         torch.full_like(b.q, float("nan")))
    check(out, b)


def test_prefill_writes_only_the_chunks_rows() -> None:
    b = batch_on_device(MIXED, hq=4, hk=2, d=16, block_size=16, dtype=torch.float32,
                        share=(4, 7))
    nd = b.meta.num_decodes
    out = torch.full_like(b.q, float("nan"))
    paged_prefill_attention_triton(b.q, b.key_cache, b.value_cache, b.meta, b.scale, out)
    assert out[:nd].isnan().all()
    check(out, b, slice(nd, None))


@pytest.mark.parametrize(("hq", "hk", "d", "block_size", "dtype"), [
    (4, 4, 64, 16, torch.float32), (9, 3, 16, 4, torch.float32),
    (8, 2, 32, 16, torch.float16),
])
def test_mixed_batch(hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype) -> None:
    # Prefix caching: sequences 4 (a decode) and 7 (a chunk) share their first blocks.
    b = batch_on_device(MIXED, hq=hq, hk=hk, d=d, block_size=block_size, dtype=dtype,
                        share=(4, 7))
    assert b.meta.num_decodes == 5
    check(paged_attention_triton(b.q, b.key_cache, b.value_cache, b.meta, b.scale), b)


def test_mixed_batch_through_ops_with_q_a_view_of_fused_qkv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = batch_on_device(MIXED, hq=8, hk=2, d=16, block_size=16,
                        dtype=torch.float32, share=(4, 7), seed=6)
    # q as the model passes it: a strided view of one [T, (Hq + 2Hk) * D] projection.
    t = b.q.shape[0]
    fused = torch.randn(t, 12 * 16, device=DEVICE)
    q = fused[:, : 8 * 16].view(t, 8, 16)
    q.copy_(b.q)
    calls = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return paged_attention_triton(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pat, "paged_attention_triton", counted)
    monkeypatch.setenv("TIDEGATE_KERNELS", "triton")
    out = ops.paged_attention(q, b.key_cache, b.value_cache, b.meta, b.scale)
    assert calls and out.is_contiguous()
    check(out, b)


def test_wrapper_names_bad_inputs() -> None:
    b = batch_on_device([(5, 1), (9, 4)], hq=4, hk=2, d=16, block_size=4, dtype=torch.float32)
    q, kc, vc, m = b.q, b.key_cache, b.value_cache, b.meta

    def run(**changes: object) -> None:
        args = {"q": q, "key_cache": kc, "value_cache": vc, "meta": m, "scale": b.scale} | changes
        paged_attention_triton(**args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="dtype"):
        run(key_cache=kc.half(), value_cache=vc.half())
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        run(q=q.double(), key_cache=kc.double(), value_cache=vc.double())
    with pytest.raises(ValueError, match="power of two"):
        run(q=q[..., :12], key_cache=kc[..., :12].contiguous(),
            value_cache=vc[..., :12].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        run(q=q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="contiguous"):
        run(key_cache=kc.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="block_tables must be a 2-D int32"):
        run(meta=dataclasses.replace(m, block_tables=m.block_tables.long()))
    with pytest.raises(ValueError, match="cover"):
        run(meta=dataclasses.replace(m, block_tables=m.block_tables[:, :2]))
    with pytest.raises(ValueError, match="out must be"):
        run(out=torch.zeros_like(q, dtype=torch.float16))
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention_triton(q[:1], kc, vc, m.block_tables[:1], m.seq_lens[:1],
                                      b.scale, 0)
    with pytest.raises(ValueError, match="partials"):
        paged_decode_attention_triton(q[:1], kc, vc, m.block_tables[:1], m.seq_lens[:1],
                                      b.scale, 2, partials=(torch.zeros(1), torch.zeros(1)))


def test_default_num_splits_fills_the_gpu_only_when_the_batch_does_not() -> None:
    assert default_num_splits(4096, batch=64, num_kv_heads=8) == 1  # 512 programs already
    assert default_num_splits(100, batch=1, num_kv_heads=8) == 1  # too short to be worth it
    assert default_num_splits(1024, batch=1, num_kv_heads=8) == 4  # one per 256 tokens
    assert default_num_splits(32768, batch=1, num_kv_heads=8) == pat.MAX_SPLITS
    assert default_num_splits(32768, batch=4, num_kv_heads=8) == 9  # ceil(264 / 32)
    assert default_num_splits(32768, batch=4, num_kv_heads=8, num_sms=16) == 1
    assert default_num_splits(0, batch=0, num_kv_heads=8) == 1


def test_prefill_tiles_never_straddle_sequences_and_cover_every_query() -> None:
    lens = [(7, 1), (5, 1), (200, 150), (9, 9), (70, 64), (100, 65)]
    meta = PagedAttentionMetadata.build(
        [[0] * 13] * len(lens), [s for s, _ in lens], [q for _, q in lens],
        [0] * sum(q for _, q in lens),
    )
    tiles = prefill_tiles(meta, 64)
    covered = sorted((seq, row) for seq, start in tiles
                     for row in range(start, min(start + 64, lens[seq][1])))
    assert covered == [(s, r) for s in range(2, len(lens)) for r in range(lens[s][1])]
    assert all(seq >= 2 and start % 64 == 0 and start < lens[seq][1] for seq, start in tiles)
    reach = [lens[seq][0] - lens[seq][1] + start for seq, start in tiles]
    assert reach == sorted(reach, reverse=True)  # the longest contexts start first
