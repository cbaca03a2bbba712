"""Grammar token masks (``tidegate.worker.engine.grammar_masks``) on the default model's tokenizer, and
the sampler under them (masks, then ``logit_bias``).

``GrammarMasks.fill`` must give, for each constrained row, exactly the mask its matcher computes
on its own (and an independent llguidance matcher fed the same tokens), leave free rows out,
continue a resumed request where it was, compile each grammar once (an LRU of templates, each
request on its own copy) and alternate its two buffers. The sampler with a mask must pick what
it picks from logits masked in plain torch (-inf outside the allowed set), greedy and seeded;
``logit_bias`` -100 bans a token, +100 forces one, only in its own row, never past a mask, and
logprobs stay those of the raw logits.
"""

from __future__ import annotations

from typing import Any

import llguidance
import numpy as np
import pytest
import torch
from pydantic import TypeAdapter

from tests.worker.engine.test_sampler import Row, row
from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer
from tidegate.structured.grammar import grammar_of, lark_grammar
from tidegate.structured.response_format import ResponseFormat
from tidegate.worker.engine.grammar_masks import GrammarMasks, GrammarUnavailable, TokenMask
from tidegate.worker.engine.sampler import LOGPROB_FLOOR, Sampler

FORMAT = TypeAdapter(ResponseFormat)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMATS: dict[str, dict[str, Any]] = {
    "schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    "object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": r"[a-z]{2,6}-[0-9]{1,3}"},
    "choice": {"type": "choice", "choices": ["yes", "no", "maybe later"]},
    "lark": {"type": "grammar", "grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'},
}
# A complete output of each format, fed as the tokenizer splits it.
DOCUMENTS = {
    "schema": '{"name": "Ann Lee", "age": 41, "tags": ["a", "b"]}',
    "object": '{"city": "Oslo", "n": [1, 2.5, null]}',
    "regex": "tide-427",
    "choice": "maybe later",
    "lark": "(1,22,333)",
}


def grammar(name: str) -> str:
    g = grammar_of(FORMAT.validate_python(FORMATS[name]))
    assert g is not None
    return g


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model())


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> int:
    return tokenizer.backend.get_vocab_size()


@pytest.fixture(scope="module")
def reference_tokenizer(tokenizer: Tokenizer, vocab: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer built here, apart from GrammarMasks."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                  eos_token=sorted(tokenizer.eos_token_ids))


def new_masks(tokenizer: Tokenizer, vocab: int, **kwargs: Any) -> GrammarMasks:
    kwargs.setdefault("max_rows", 8)
    return GrammarMasks(tokenizer, vocab, **kwargs)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def words_of(matcher: llguidance.LLMatcher, words: int) -> np.ndarray:
    """A matcher's own mask as int32 words; the words past ``words`` (llguidance's own
    padding) must allow nothing."""
    own = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
    assert not own[words:].any()
    return own[:words]


def allowed(bits: torch.Tensor, vocab: int) -> set[int]:
    """The ids one packed mask row allows."""
    flags = (bits[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(flags.flatten()[:vocab].nonzero().flatten().tolist())


def unpacked(mask: TokenMask, vocab: int) -> torch.Tensor:
    """[C, vocab] bool."""
    flags = (mask.bits[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return flags.reshape(mask.bits.shape[0], -1)[:, :vocab].bool()


# ---------------------------------------------------------------- masks


def test_fill_equals_each_matchers_own_mask_and_an_independent_matcher(
        tokenizer: Tokenizer, vocab: int, reference_tokenizer: llguidance.LLTokenizer) -> None:
    masks = new_masks(tokenizer, vocab)
    ids = list(DOCUMENTS)
    references = {}
    for n, name in enumerate(ids):
        masks.add(name, grammar(name))
        references[name] = llguidance.LLMatcher(reference_tokenizer, grammar(name), log_level=0)
        # Each request a different way into its document (the first at its start).
        for token in encode(tokenizer, DOCUMENTS[name])[:2 * n]:
            assert masks.consume(name, token)
            assert references[name].consume_token(token)
    mask = masks.fill(ids)
    assert mask is not None
    assert mask.rows == list(range(len(ids)))
    assert mask.bits.shape == (len(ids), masks.words) and mask.bits.dtype == torch.int32
    for i, name in enumerate(ids):
        got = mask.bits[i].numpy()
        assert np.array_equal(got, words_of(masks._matchers[name], masks.words)), name
        assert np.array_equal(got, words_of(references[name], masks.words)), name
        assert got.any(), name
    # At its start a JSON document allows only tokens starting with "{".
    first = allowed(mask.bits[ids.index("schema")], vocab)
    assert first and all(tokenizer.decode([t]).startswith("{") for t in first)


def test_masks_follow_a_whole_document_to_its_end(
        tokenizer: Tokenizer, vocab: int, reference_tokenizer: llguidance.LLTokenizer) -> None:
    masks = new_masks(tokenizer, vocab)
    for name, text in DOCUMENTS.items():
        masks.add(name, grammar(name))
        reference = llguidance.LLMatcher(reference_tokenizer, grammar(name), log_level=0)
        for token in encode(tokenizer, text):
            mask = masks.fill([name])
            assert mask is not None
            assert token in allowed(mask.bits[0], vocab), (name, token)
            assert np.array_equal(mask.bits[0].numpy(), words_of(reference, masks.words))
            assert not masks.is_complete(name)
            assert masks.consume(name, token) and reference.consume_token(token)
        mask = masks.fill([name])
        assert mask is not None
        # Every document here is closed: only an end-of-sequence token may follow.
        assert allowed(mask.bits[0], vocab) <= set(tokenizer.eos_token_ids)
        assert masks.is_complete(name), name


def test_rows_with_no_grammar_are_left_out(tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    masks.add("a", grammar("regex"))
    masks.add("b", grammar("choice"))
    assert len(masks) == 2 and "a" in masks and "free" not in masks
    mask = masks.fill(["free0", "a", "free1", "b", "free2"])
    assert mask is not None
    assert mask.rows == [1, 3] and mask.bits.shape[0] == 2
    assert np.array_equal(mask.bits[0].numpy(), words_of(masks._matchers["a"], masks.words))
    assert np.array_equal(mask.bits[1].numpy(), words_of(masks._matchers["b"], masks.words))
    assert masks.fill(["free0", "free1"]) is None
    assert masks.fill([]) is None
    masks.remove("a")
    masks.remove("never-added")
    mask = masks.fill(["free0", "a", "free1", "b"])
    assert mask is not None and mask.rows == [3]
    # A free request's token is never refused, and it never completes a grammar.
    assert masks.consume("free0", 12345) and not masks.is_complete("free0")


def test_a_refused_token_is_reported(tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    masks.add("c", grammar("choice"))
    mask = masks.fill(["c"])
    assert mask is not None
    refused = next(t for t in range(vocab) if t not in allowed(mask.bits[0], vocab))
    assert not masks.consume("c", refused)
    assert masks.error("c")


def test_a_resumed_request_continues_where_it_was(
        tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    tokens = encode(tokenizer, DOCUMENTS["schema"])
    cut = len(tokens) // 2
    masks.add("live", grammar("schema"))
    for token in tokens[:cut]:
        assert masks.consume("live", token)
    masks.add("resumed", grammar("schema"), generated=tokens[:cut])
    fresh = masks.fill(["fresh-free", "resumed"])
    assert fresh is not None
    for token in tokens[cut:]:
        mask = masks.fill(["live", "resumed"])
        assert mask is not None
        assert torch.equal(mask.bits[0], mask.bits[1])
        assert masks.consume("live", token) and masks.consume("resumed", token)
    assert masks.is_complete("live") and masks.is_complete("resumed")


def test_resumed_tokens_that_break_the_grammar_are_refused(
        tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    with pytest.raises(GrammarUnavailable, match="already generated break the grammar"):
        masks.add("bad", grammar("choice"), generated=encode(tokenizer, "nope"))
    assert "bad" not in masks and len(masks) == 0


def test_the_template_cache_compiles_once_and_each_request_gets_a_copy(
        tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    g = grammar("schema")
    masks.check(g)
    assert len(masks._templates) == 1 and len(masks) == 0  # checked, cached, not a request
    template = masks._templates[g]
    masks.add("a", g)
    for token in encode(tokenizer, DOCUMENTS["schema"])[:3]:
        assert masks.consume("a", token)
    masks.add("b", g)
    assert len(masks._templates) == 1 and masks._templates[g] is template
    mask = masks.fill(["a", "b"])
    assert mask is not None
    # "b" starts at the beginning although "a", from the same template, moved on.
    assert not torch.equal(mask.bits[0], mask.bits[1])
    assert np.array_equal(mask.bits[1].numpy(), words_of(template, masks.words))


def test_the_template_cache_drops_the_least_recently_used(
        tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab, cache_size=2)
    g1, g2, g3 = grammar("regex"), grammar("choice"), grammar("lark")
    masks.add("r1", g1)
    masks.add("r2", g2)
    first = masks._templates[g1]
    masks.check(g1)  # used again: g2 is now the least recent
    masks.add("r3", g3)
    assert list(masks._templates) == [g1, g3]
    assert masks._templates[g1] is first
    # Requests already running keep their matchers.
    assert masks.fill(["r1", "r2", "r3"]) is not None and len(masks) == 3
    masks.add("r4", g2)  # compiled again; now g1 is the least recent
    assert list(masks._templates) == [g3, g2]


def test_a_grammar_that_does_not_compile_for_the_tokenizer_is_refused(
        tokenizer: Tokenizer, vocab: int) -> None:
    # Compiles without a tokenizer; this one has no such special token.
    g = lark_grammar('start: "a" <|no_such_token|>')
    masks = new_masks(tokenizer, vocab)
    with pytest.raises(GrammarUnavailable, match="no_such_token"):
        masks.check(g)
    with pytest.raises(GrammarUnavailable):
        masks.add("x", g)
    assert len(masks._templates) == 0 and "x" not in masks


def test_a_padded_vocabulary_never_allows_the_ids_past_the_tokenizer(
        tokenizer: Tokenizer, vocab: int) -> None:
    padded = vocab + 100
    masks = new_masks(tokenizer, padded)
    assert masks.words == (padded + 31) // 32
    masks.add("o", grammar("object"))
    masks.add("r", grammar("regex"))
    mask = masks.fill(["o", "r"])
    assert mask is not None and mask.bits.shape == (2, masks.words)
    flags = unpacked(mask, padded)
    assert not flags[:, vocab:].any() and flags[:, :vocab].any(dim=1).all()


def test_fill_async_equals_fill(tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    for name in DOCUMENTS:
        masks.add(name, grammar(name))
        for token in encode(tokenizer, DOCUMENTS[name])[:1]:
            masks.consume(name, token)
    ids = ["free", *DOCUMENTS]
    sync = masks.fill(ids)
    assert sync is not None
    expected = (sync.rows, sync.bits.clone())
    threaded = masks.fill_async(ids).result()
    assert threaded is not None
    assert threaded.rows == expected[0] and torch.equal(threaded.bits, expected[1])
    assert masks.stats.fills == 2 and masks.stats.rows == 2 * len(DOCUMENTS)


def test_the_two_buffers_alternate(tokenizer: Tokenizer, vocab: int) -> None:
    """A step's masks stay intact while the next step's are written."""
    masks = new_masks(tokenizer, vocab)
    masks.add("s", grammar("schema"))
    first = masks.fill(["s"])
    assert first is not None
    kept = first.bits.clone()
    assert masks.consume("s", encode(tokenizer, DOCUMENTS["schema"])[0])
    second = masks.fill(["s"])
    assert second is not None
    assert torch.equal(first.bits, kept)
    assert not torch.equal(second.bits, kept)
    assert first.bits.data_ptr() != second.bits.data_ptr()


def test_more_constrained_rows_than_max_rows_are_refused(
        tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab, max_rows=2)
    for i in range(3):
        masks.add(f"r{i}", grammar("choice"))
    assert masks.fill(["r0", "r1"]) is not None
    with pytest.raises(ValueError, match="at most 2"):
        masks.fill(["r0", "r1", "r2"])


# ---------------------------------------------------------------- the sampler under masks


def masked_in_torch(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """The reference: -inf outside each constrained row's allowed set."""
    out = logits.clone()
    flags = unpacked(mask, logits.shape[1])
    for i, r in enumerate(mask.rows):
        out[r] = out[r].masked_fill(~flags[i], float("-inf"))
    return out


def mixed_rows() -> list[Row]:
    """Constrained and free rows, greedy and sampled (seeded, with filters and penalties)."""
    return [
        row("schema"),
        row("free-greedy"),
        row("object", temperature=0.9, seed=1),
        row("regex", temperature=1.2, top_p=0.8, seed=2),
        row("free-sampled", temperature=1.0, seed=3),
        row("choice", temperature=0.7, top_k=5, seed=4),
        row("lark", repetition_penalty=1.3, output=[16, 17], seed=5),
        row("lark-sampled", temperature=1.0, min_p=0.1, presence_penalty=0.5, output=[16],
            seed=6),
    ]


def test_masks_in_the_sampler_equal_masking_the_logits_in_plain_torch(
        tokenizer: Tokenizer, vocab: int) -> None:
    masks = new_masks(tokenizer, vocab)
    batch = mixed_rows()
    for r in batch:
        name = r.request_id.removesuffix("-sampled")
        if name in FORMATS:
            masks.add(r.request_id, grammar(name))
    with_mask, reference = Sampler(), Sampler()
    gen = torch.Generator().manual_seed(0)
    changed = 0
    for _ in range(4):  # a few steps: the seeded rows' generators move on in lockstep
        logits = 3 * torch.randn(len(batch), vocab, generator=gen)
        mask = masks.fill([r.request_id for r in batch])
        assert mask is not None and len(mask.rows) == 6
        expected = reference(masked_in_torch(logits, mask), batch).token_ids
        got = with_mask(logits.clone(), batch, mask).token_ids
        assert got == expected
        flags = unpacked(mask, vocab)
        for i, r in enumerate(mask.rows):
            assert flags[i, got[r]], batch[r].request_id
        changed += sum(got[r] != int(logits[r].argmax()) for r in mask.rows)
        for r in mask.rows:  # advance each constrained row by its token
            assert masks.consume(batch[r].request_id, got[r])
    assert changed > 0  # the masks really changed the choice


def test_hand_made_masks_in_the_sampler_equal_the_reference() -> None:
    vocab, n = 300, 6
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(n, vocab, generator=gen)
    bits = torch.randint(-(2**31), 2**31, (3, (vocab + 31) // 32), generator=gen,
                         dtype=torch.int64).to(torch.int32)
    bits[2] = 0
    bits[2, 9] = 1 << 4  # one allowed token: 9 * 32 + 4 = 292
    mask = TokenMask([5, 0, 3], bits)
    batch = [row("a"), row("b", temperature=1.0, seed=1), row("c"),
             row("d", temperature=0.8, top_k=10, seed=2), row("e"),
             row("f", temperature=1.0, top_p=0.5, seed=3)]
    expected = Sampler()(masked_in_torch(logits, mask), batch).token_ids
    got = Sampler()(logits.clone(), batch, mask).token_ids
    assert got == expected
    assert got[3] == 292
    assert got[2] == int(logits[2].argmax()) and got[4] == int(logits[4].argmax())


# ---------------------------------------------------------------- logit_bias


def peaked(n: int, vocab: int, peak: int, seed: int = 0) -> torch.Tensor:
    """Logits whose every row's argmax is ``peak``, by a margin."""
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))
    logits[:, peak] = logits.max() + 5
    return logits


def test_a_bias_of_minus_100_bans_a_token() -> None:
    vocab, peak = 500, 123
    logits = peaked(3, vocab, peak)
    batch = [row("g", logit_bias={peak: -100}),
             row("s", temperature=0.5, seed=1, logit_bias={peak: -100}),
             row("free")]
    for _ in range(20):
        out = Sampler()(logits.clone(), batch).token_ids
        assert out[0] == int(logits[0].clone().index_fill_(0, torch.tensor([peak]),
                                                           float("-inf")).argmax())
        assert out[1] != peak
        assert out[2] == peak  # the bias is its own row's alone


def test_a_bias_of_plus_100_forces_a_token() -> None:
    vocab = 500
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    low = [int(r.argmin()) for r in logits]
    batch = [row("g", logit_bias={low[0]: 100}),
             row("s", temperature=1.0, seed=4, logit_bias={low[1]: 100}),
             row("both", logit_bias={low[2]: 100, int(logits[2].argmax()): -100}),
             row("free")]
    out = Sampler()(logits.clone(), batch).token_ids
    assert out[:3] == low[:3]
    assert out[3] == int(logits[3].argmax())


def test_a_bias_applies_only_to_its_own_row() -> None:
    vocab, peak = 400, 7
    logits = peaked(4, vocab, peak, seed=3)
    target = 300
    batch = [row("free-a"), row("banned", logit_bias={peak: -100}), row("free-b"),
             row("pushed", logit_bias={target: 100})]
    out = Sampler()(logits.clone(), batch).token_ids
    assert out[0] == out[2] == peak
    assert out[1] != peak and out[3] == target


def test_a_bias_past_the_vocabulary_is_ignored() -> None:
    vocab = 200
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    plain = Sampler()(logits.clone(), [row("a"), row("b")]).token_ids
    out = Sampler()(logits.clone(), [row("a", logit_bias={vocab + 5: 100}),
                                     row("b", logit_bias={10**6: -100})]).token_ids
    assert out == plain


def test_a_bias_never_lifts_a_token_past_its_mask() -> None:
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = (1 << 3) | (1 << 9)  # tokens 3 and 9 only
    mask = TokenMask([0], bits)
    for params in ({"logit_bias": {40: 100}}, {"logit_bias": {40: 100}, "temperature": 1.0}):
        out = Sampler()(logits.clone(), [row("m", seed=1, **params)], mask).token_ids
        assert out[0] in (3, 9)
    pushed = Sampler()(logits.clone(), [row("m", logit_bias={3: 100, 9: -100})], mask)
    assert pushed.token_ids == [3]


def test_logprobs_stay_those_of_the_raw_logits_under_bias_and_mask() -> None:
    vocab = 300
    logits = 2 * torch.randn(3, vocab, generator=torch.Generator().manual_seed(6))
    raw = logits.log_softmax(-1)
    low = int(logits[0].argmin())
    bits = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bits[0, 2] = 1 << 5  # row 2 may pick token 69 only
    batch = [row("biased", logprobs=3, logit_bias={low: 100}),
             row("free", logprobs=2),
             row("masked", logprobs=4, temperature=1.0, seed=7)]
    out = Sampler()(logits.clone(), batch, TokenMask([2], bits))
    assert out.token_ids == [low, int(logits[1].argmax()), 69]
    for i, n in enumerate((3, 2, 4)):
        lp = out.logprobs[i]
        assert lp is not None
        chosen = out.token_ids[i]
        assert lp.logprob == pytest.approx(max(raw[i, chosen].item(), LOGPROB_FLOOR), abs=1e-5)
        values, ids = raw[i].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
    # The forced and the masked tokens are unlikely under the raw logits.
    assert out.logprobs[0] is not None and out.logprobs[0].logprob < raw[0].max().item() - 1
