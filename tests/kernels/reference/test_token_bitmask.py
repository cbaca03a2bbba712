"""Grammar token masks on logits: the plain-torch reference against hand-made masks, and the
Triton kernel against the reference.

A mask row packs one bit per token into int32 words (bit ``t % 32`` of word ``t // 32``). The
reference must leave exactly the allowed ids of each masked row finite and untouched, never
touch a row without a mask, and treat ids past the mask's width as disallowed, for vocabularies
that are not a multiple of 32. Without CUDA the Triton kernel runs in Triton's interpreter
(``tests/conftest.py`` sets TRITON_INTERPRET), so shapes stay small; logits are float32 only.
"""

from __future__ import annotations

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.gpu import token_bitmask_triton as bitmask_triton
from tidegate.kernels.gpu.token_bitmask_triton import apply_token_bitmask_triton
from tidegate.kernels.reference.token_bitmask import apply_token_bitmask_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def pack(allowed: list[set[int]], words: int) -> torch.Tensor:
    """Each row's allowed ids as packed int32 words (bit 31 makes a word negative)."""
    out = torch.zeros(len(allowed), words, dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for w in range(words):
            value = sum(1 << (t - 32 * w) for t in ids if t // 32 == w)
            out[r, w] = value - (1 << 32) if value >= 1 << 31 else value
    return out.to(DEVICE)


def random_bits(rows: int, words: int) -> torch.Tensor:
    """Random packed masks over all 32 bits of each word, sign bit included."""
    bits = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64)
    return bits.to(torch.int32).to(DEVICE)


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[C, W] packed words -> [C, vocab] bool, ids past 32W False (independent of the kernels:
    one Python int per word)."""
    out = torch.zeros(bits.shape[0], vocab, dtype=torch.bool)
    for r, row in enumerate(bits.cpu().tolist()):
        for w, word in enumerate(row):
            for b in range(32):
                t = 32 * w + b
                if t < vocab and (word >> b) & 1:
                    out[r, t] = True
    return out


def long_rows(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=DEVICE)


def expected(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """What masking must give: disallowed logits of masked rows -inf, everything else kept."""
    out = logits.clone()
    allowed = unpack(bits, logits.shape[1]).to(logits.device)
    for i, r in enumerate(rows):
        out[r] = logits[r].masked_fill(~allowed[i], NEG_INF)
    return out


# --- the reference ----------------------------------------------------------------------------


def test_reference_leaves_exactly_the_allowed_ids_finite() -> None:
    vocab = 96
    logits = torch.randn(2, vocab, device=DEVICE)
    # Both ends of every word, the sign bit (31) among them, and a lone id.
    allowed = [{0, 31, 32, 63, 64, 95}, {17}]
    before = logits.clone()
    apply_token_bitmask_ref(logits, pack(allowed, 3), long_rows([0, 1]))
    for r, ids in enumerate(allowed):
        finite = set(torch.isfinite(logits[r]).nonzero().flatten().tolist())
        assert finite == ids
        assert torch.equal(logits[r, sorted(ids)], before[r, sorted(ids)])
        assert bool((logits[r][~torch.isfinite(logits[r])] == NEG_INF).all())


def test_reference_touches_only_the_masked_rows_in_the_order_rows_names_them() -> None:
    vocab = 64
    logits = torch.randn(5, vocab, device=DEVICE)
    before = logits.clone()
    # Mask 0 belongs to logits row 3 and mask 1 to row 1: not in row order.
    bits = pack([{5, 40}, {7}], 2)
    apply_token_bitmask_ref(logits, bits, long_rows([3, 1]))
    for r in (0, 2, 4):
        assert torch.equal(logits[r], before[r])
    assert set(torch.isfinite(logits[3]).nonzero().flatten().tolist()) == {5, 40}
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == {7}


def test_reference_with_no_rows_changes_nothing() -> None:
    logits = torch.randn(3, 40, device=DEVICE)
    before = logits.clone()
    apply_token_bitmask_ref(logits, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
                            long_rows([]))
    assert torch.equal(logits, before)


def test_reference_vocab_not_a_multiple_of_32_ignores_the_padding_bits() -> None:
    vocab = 70  # 3 words: 26 bits past the vocabulary, set here, must change nothing
    logits = torch.randn(2, vocab, device=DEVICE)
    bits = pack([{1, 69, 70, 80, 95}, set(range(vocab))], 3)
    before = logits.clone()
    apply_token_bitmask_ref(logits, bits, long_rows([0, 1]))
    assert logits.shape == (2, vocab)
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {1, 69}
    assert torch.equal(logits[1], before[1])  # every id allowed: the row is unchanged


def test_reference_vocab_wider_than_the_mask_disallows_the_ids_past_it() -> None:
    vocab = 100  # a padded vocabulary: the mask covers 64 ids
    logits = torch.randn(2, vocab, device=DEVICE)
    bits = pack([set(range(64)), {3, 63}], 2)
    before = logits.clone()
    apply_token_bitmask_ref(logits, bits, long_rows([0, 1]))
    assert torch.equal(logits[0, :64], before[0, :64])
    assert bool((logits[0, 64:] == NEG_INF).all())
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == {3, 63}


def test_reference_matches_an_independent_unpacking_on_random_masks() -> None:
    vocab, words = 200, 7  # 224 bits: 24 padding bits per row
    logits = torch.randn(6, vocab, device=DEVICE)
    bits = random_bits(4, words)
    rows = [5, 0, 2, 3]
    want = expected(logits, bits, rows)
    apply_token_bitmask_ref(logits, bits, long_rows(rows))
    assert torch.equal(logits, want)


# --- the Triton kernel ------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "vocab", "words", "rows"), [
    (4, 96, 3, [0, 1, 2, 3]),  # every row masked, vocab a multiple of 32
    (5, 70, 3, [4, 1]),  # vocab not a multiple of 32, rows out of order, others untouched
    (3, 100, 2, [2, 0]),  # vocab wider than the mask
    (3, 2500, 79, [1, 2]),  # three column blocks of 1024, the last partial
    (2, 33, 2, [1]),  # one word plus a single bit
])
def test_triton_kernel_equals_the_reference(n: int, vocab: int, words: int,
                                            rows: list[int]) -> None:
    logits = torch.randn(n, vocab, device=DEVICE)
    bits = random_bits(len(rows), words)
    ref, tri = logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bits, long_rows(rows))
    apply_token_bitmask_triton(tri, bits, long_rows(rows))
    assert torch.equal(tri, ref)
    assert torch.equal(ref, expected(logits, bits, rows))


def test_triton_kernel_on_hand_made_masks_and_all_or_nothing_words() -> None:
    vocab = 128
    logits = torch.randn(4, vocab, device=DEVICE)
    bits = pack([{0, 31, 32, 127}, set(range(vocab)), set(), {64}], 4)
    ref, tri = logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bits, long_rows([0, 1, 2, 3]))
    apply_token_bitmask_triton(tri, bits, long_rows([0, 1, 2, 3]))
    assert torch.equal(tri, ref)
    assert set(torch.isfinite(tri[0]).nonzero().flatten().tolist()) == {0, 31, 32, 127}
    assert torch.equal(tri[1], logits[1])
    assert bool((tri[2] == NEG_INF).all())


def test_triton_kernel_on_rows_of_a_wider_tensor_keeps_the_columns_past_the_view() -> None:
    """Logits as a row-strided view (stride != vocab): only the view's columns change."""
    vocab, pad = 70, 10
    base = torch.randn(3, vocab + pad, device=DEVICE)
    bits = random_bits(2, 3)
    ref_base, tri_base = base.clone(), base.clone()
    apply_token_bitmask_ref(ref_base[:, :vocab], bits, long_rows([2, 0]))
    apply_token_bitmask_triton(tri_base[:, :vocab], bits, long_rows([2, 0]))
    assert torch.equal(tri_base, ref_base)
    assert torch.equal(tri_base[:, vocab:], base[:, vocab:])


def test_triton_kernel_with_no_rows_changes_nothing() -> None:
    logits = torch.randn(2, 64, device=DEVICE)
    before = logits.clone()
    apply_token_bitmask_triton(logits, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
                               long_rows([]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_dispatcher_serves_the_mode_and_gives_the_same_result(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = bitmask_triton.apply_token_bitmask_triton

    def counted(*args: torch.Tensor) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(bitmask_triton, "apply_token_bitmask_triton", counted)
    monkeypatch.setenv("TIDEGATE_KERNELS", mode)
    logits = torch.randn(3, 150, device=DEVICE)
    bits = random_bits(2, 5)
    want = expected(logits, bits, [1, 2])
    ops.apply_token_bitmask(logits, bits, long_rows([1, 2]))
    assert torch.equal(logits, want)
    assert len(calls) == (mode == "triton")
