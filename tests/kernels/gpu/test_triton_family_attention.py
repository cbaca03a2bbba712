"""The Triton paged attention kernels' sliding window and soft-capping, and GELU-and-mul, against
``paged_attention_ref`` / ``paged_decode_attention`` / ``gelu_and_mul_ref`` and against dense
float64 attention that slices each query's visible keys out explicitly.

Batches come from ``make_batch`` (shuffled blocks; padding, unused blocks and unwritten tails
hold NaN, so a stray read fails), with the queries scaled by ``SCORE_GAIN`` so that raw scores
reach ~10: soft-capping at 2 then changes every row. Every output and scratch buffer the
wrappers allocate starts as NaN. Without CUDA the kernels run in Triton's interpreter, which is
slow: contexts stay at or under 300 tokens and heads few. float32 and float16 only (the
interpreter's bfloat16 tl.dot is wrong; ``tests/gpu`` has it).

Windows: 5 (under a page of 16), 16 (one page), 70 (over a tile of 64: the window's first tile
is masked, the rest of the context is the masked tail) and 150 (over two tiles: the only one
that leaves a decode or a prefill tile an unmasked run inside the window).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.cpu.test_paged_attention import Batch, assert_close
from tests.kernels.gpu.test_triton_attention import DEVICE, batch_on_device
from tests.kernels.gpu.test_triton_attention import (
    poisoned_empty as poisoned_empty,  # autouse: NaN empties
)
from tidegate.kernels.cpu.paged_attention import paged_attention_ref, paged_decode_attention
from tidegate.kernels.gpu.activation_triton import gelu_and_mul_triton
from tidegate.kernels.gpu.paged_attention_triton import (
    DECODE_BLOCK_N,
    paged_attention_triton,
    paged_decode_attention_triton,
)
from tidegate.kernels.reference.activation import gelu_and_mul_ref

# Raw scores q.k * scale have a standard deviation of ~SCORE_GAIN: the largest reach ~10.
SCORE_GAIN = 4.0
SOFTCAP = 2.0
WINDOWS = [None, 5, 16, 70, 150]
# Decodes first: one token, under a page, a page, a tile and a bit, several tiles; 260: with a
# window of 70 the split starts at tile 2 (masked), tile 3 is unmasked, the tail masked.
# Prefill chunks: no cached prefix, a prefix ending mid-block, three query tiles after a
# prefix, and a chunk whose first tile (first position 130) has an unmasked run under a window
# of 150. Sequences 5 (a decode) and 10 (a chunk) share their first blocks.
MIXED = [(1, 1), (5, 1), (16, 1), (70, 1), (130, 1), (200, 1), (260, 1),
         (23, 23), (50, 13), (200, 150), (200, 70)]
SHARE = (5, 10)
# Decodes alone, longer: with 3 splits a window leaves the long rows' last splits empty.
DECODES = [(1, 1), (5, 1), (16, 1), (64, 1), (70, 1), (130, 1), (200, 1), (300, 1)]



def dense_attention(b: Batch, window: int | None, softcap: float | None) -> torch.Tensor:
    """float64 attention of each query row over exactly the keys it sees (positions
    p - window < k <= p, read back through the host block table), no masks -> [T, Hq, D]."""
    q = b.q.double().cpu()
    kc, vc = b.key_cache.double().cpu(), b.value_cache.double().cpu()
    block_size, group = kc.shape[1], q.shape[1] // kc.shape[2]
    m = b.meta
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for s, (seq_len, q_len) in enumerate(zip(m.seq_lens_host, m.query_lens_host, strict=True)):
        pos = torch.arange(seq_len)
        blocks = m.block_tables[s].cpu().long()[pos // block_size]
        k = kc[blocks, pos % block_size].repeat_interleave(group, dim=1)
        v = vc[blocks, pos % block_size].repeat_interleave(group, dim=1)
        for p in range(seq_len - q_len, seq_len):
            lo = 0 if window is None else max(p - window + 1, 0)
            scores = torch.einsum("hd,khd->hk", q[row], k[lo : p + 1]) * b.scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : p + 1])
            row += 1
    return out


def family_batch(seqs: list[tuple[int, int]], window: int | None, softcap: float | None,
                 **kwargs: object) -> Batch:
    """``batch_on_device`` with loud queries; ``expected`` is the dense windowed, capped
    attention."""
    b = batch_on_device(seqs, **kwargs)
    b = dataclasses.replace(b, q=b.q * SCORE_GAIN)
    return dataclasses.replace(b, expected=dense_attention(b, window, softcap))


def reference(b: Batch, window: int | None, softcap: float | None) -> torch.Tensor:
    """``paged_attention_ref`` in float32 on the batch's (possibly float16) values."""
    return paged_attention_ref(b.q.float(), b.key_cache.float(), b.value_cache.float(), b.meta,
                               b.scale, window=window, softcap=softcap)


def check(out: torch.Tensor, b: Batch, ref: torch.Tensor) -> None:
    dtype = b.q.dtype
    assert_close(out.cpu(), b.expected, dtype)
    assert_close(out.cpu(), ref.cpu().to(dtype), dtype)


def assert_features_matter(b: Batch, window: int | None, softcap: float | None) -> None:
    """The case can fail: the window and the cap each move the exact result well past any
    tolerance (so a kernel ignoring either would not pass)."""
    if window is not None:
        plain = dense_attention(b, None, softcap)
        assert (b.expected - plain).abs().max() > 0.1
    if softcap is not None:
        uncapped = dense_attention(b, window, None)
        assert (b.expected - uncapped).abs().max() > 0.1


def empty_splits(seq_lens: list[int], window: int, num_splits: int) -> torch.Tensor:
    """[B, num_splits] bool: the splits the decode kernel leaves without keys, the context
    (from the window's first tile on) shared among the splits in whole tiles."""
    rows = []
    for n in seq_lens:
        tile0 = max(n - window, 0) // DECODE_BLOCK_N
        per_split = -(-(-(-n // DECODE_BLOCK_N) - tile0) // num_splits)
        rows.append([(tile0 + s * per_split) * DECODE_BLOCK_N >= n for s in range(num_splits)])
    return torch.tensor(rows)


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}")
@pytest.mark.parametrize(("hq", "hk", "d", "block_size", "dtype"), [
    (4, 2, 32, 16, torch.float32), (6, 2, 16, 4, torch.float16),
], ids=["fp32-page16", "fp16-page4"])
def test_mixed_batch_with_window_and_softcap(hq: int, hk: int, d: int, block_size: int,
                                             dtype: torch.dtype, window: int | None,
                                             softcap: float | None) -> None:
    b = family_batch(MIXED, window, softcap, hq=hq, hk=hk, d=d, block_size=block_size,
                     dtype=dtype, share=SHARE, seed=11)
    assert b.meta.num_decodes == 7
    assert_features_matter(b, window, softcap)
    out = paged_attention_triton(b.q, b.key_cache, b.value_cache, b.meta, b.scale,
                                 window=window, softcap=softcap)
    check(out, b, reference(b, window, softcap))


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", [5, 16, 70, 150], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_window_and_softcap(num_splits: int, window: int,
                                        softcap: float | None) -> None:
    b = family_batch(DECODES, window, softcap, hq=8, hk=2, d=32, block_size=16,
                     dtype=torch.float32, seed=12)
    assert_features_matter(b, window, softcap)
    m, n = b.meta, len(DECODES)
    partials = None
    if num_splits > 1:
        partials = (torch.full((n, 8, num_splits, 32), float("nan"), device=DEVICE),
                    torch.full((n, 8, num_splits), float("nan"), device=DEVICE))
    out = paged_decode_attention_triton(b.q, b.key_cache, b.value_cache, m.block_tables,
                                        m.seq_lens, b.scale, num_splits, partials=partials,
                                        window=window, softcap=softcap)
    ref = paged_decode_attention(b.q, b.key_cache, b.value_cache, m.block_tables, m.seq_lens,
                                 b.scale, window=window, softcap=softcap)
    check(out, b, ref)
    if partials is not None:
        # A split without keys says so (lse -inf, zeros), and only such a split: the window
        # moves the splits to its own tiles, so the long rows' last splits are empty too.
        empty = empty_splits(m.seq_lens_host, window, num_splits)
        if window < DECODE_BLOCK_N:
            assert empty[-1, 1:].all()  # 300 tokens: 5 tiles, but the window's is the last
        lse = partials[1].cpu()
        assert torch.equal(lse == float("-inf"), empty[:, None, :].expand_as(lse))
        assert (partials[0].cpu()[empty[:, None, :].expand_as(lse)] == 0).all()


def test_decode_window_covering_the_context_is_no_window() -> None:
    b = family_batch(DECODES, None, SOFTCAP, hq=4, hk=4, d=16, block_size=16,
                     dtype=torch.float32, seed=13)
    m = b.meta
    out = paged_decode_attention_triton(b.q, b.key_cache, b.value_cache, m.block_tables,
                                        m.seq_lens, b.scale, 3, window=max(m.seq_lens_host),
                                        softcap=SOFTCAP)
    check(out, b, reference(b, None, SOFTCAP))


def test_prefill_window_with_very_negative_scores() -> None:
    # Softmax is shift-invariant: every score ~100 lower must not change the result. Keys share
    # a direction the queries point away from (raw scores ~-100, spread ~5).
    b = batch_on_device([(200, 150)], hq=2, hk=2, d=16, block_size=16, dtype=torch.float32,
                        seed=15)
    kc = b.key_cache
    kc = torch.where(kc.isnan(), kc, 1.0 + 0.05 * kc)
    b = dataclasses.replace(b, q=b.q - 100.0 / (16 * b.scale), key_cache=kc)
    b = dataclasses.replace(b, expected=dense_attention(b, 5, None))
    out = paged_attention_triton(b.q, b.key_cache, b.value_cache, b.meta, b.scale, window=5)
    # Scores of ~-100 carry float32 rounding of ~1e-5 (the weights move by as much): 1e-4.
    ref = reference(b, 5, None)
    assert torch.isfinite(out).all()
    for want in (b.expected, ref.double()):
        torch.testing.assert_close(out.cpu().double(), want.cpu(), atol=1e-4, rtol=1e-4)


# The interpreter's exp is NumPy's, which warns where exp(2u) overflows to inf (the warning is
# an error here); the kernel means it to: 2 / (inf + 1) is 0, tanh 1.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(("tokens", "inter"), [(1, 8), (7, 96), (3, 1100)])  # 1100: 2 blocks
def test_gelu_and_mul_matches_reference(tokens: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(14)
    x = 3 * torch.randn(tokens, 2 * inter + 16, generator=gen)[:, : 2 * inter]  # stride != 2I
    # The tanh's far ends: exp(2u) overflows float32 for a gate past ~10.
    x[0, :4] = torch.tensor([-30.0, 30.0, -8.0, 12.0])
    x = x.to(DEVICE)
    x_before = x.clone()

    out = gelu_and_mul_triton(x)

    assert out.shape == (tokens, inter) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, gelu_and_mul_ref(x), rtol=1e-5, atol=1e-5)
    # Not silu: the two activations differ by far more than the tolerance.
    gate, up = x.chunk(2, dim=-1)
    assert (out - torch.nn.functional.silu(gate) * up).abs().max() > 0.1
    assert torch.equal(x, x_before)
