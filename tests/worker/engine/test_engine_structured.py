"""Structured outputs through the engine: ``response_format`` requests batched with free ones,
on ``random:tiny`` (fast) and on the default model (slow).

Every constrained output must be what its format says (a JSON document valid under its schema,
a JSON object, a full regex match, one of the choices, a sentence of the Lark grammar) and end
with finish_reason "stop" when its grammar is complete, greedy or seeded. Free requests in the
same batch must get exactly what they get alone. The plain engine and the overlapped one with
async scheduling (which defers the sampling of steps with constrained rows until the previous
step's tokens are read; on the CPU too) must give every request the same tokens, text, finish
reason and logprobs, and so must a KV cache small enough to preempt. A request resumed from
part of its tokens finishes with the same text; a format that cannot be compiled is a
``RequestError`` before anything runs.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import jsonschema
import pytest

from tests.worker.engine.test_engine import run_all
from tidegate.protocol import SamplingParams
from tidegate.structured.grammar import lark_grammar, validation_error
from tidegate.structured.response_format import GrammarFormat, RegexFormat
from tidegate.worker.engine.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    RequestError,
    RequestOutput,
    ResumeError,
)
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "student": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "pet", "student", "tags"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe later"]
PATTERN = r"[a-z]{2,6}-[0-9]{1,3}"
# Bounded (at most four numbers of two digits): even a random model's greedy loop closes it.
LARK = 'start: "(" NUM ("," NUM)? ("," NUM)? ("," NUM)? ")"\nNUM: /[1-9][0-9]?/'
FORMATS: dict[str, dict[str, Any]] = {
    "schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    "object": {"type": "json_object"},
    "regex": {"type": "regex", "pattern": PATTERN},
    "choice": {"type": "choice", "choices": CHOICES},
    "lark": {"type": "grammar", "grammar": LARK},
}
PROMPTS = {
    "schema": "Describe a fictional person as JSON: name, age, pet, student, tags.",
    "object": 'Reply with a JSON object holding one key, "capital", for France.',
    "regex": "Invent a short product code.",
    "choice": "Is the sky blue? Answer yes or no.",
    "lark": "List three small numbers in parentheses, separated by commas.",
    "free": "What is the capital of France?",
    "free2": "Write a haiku about the sea.",
}

def max_tokens(loaded: LoadedModel) -> int:
    """Room for every constrained output to close: a byte-level tokenizer spends up to four
    tokens on a character of a random model's strings."""
    return 200 if loaded.source.kind == "random" else 64


def conforms(kind: str, text: str) -> None:
    """Assert that ``text`` is a complete output of the format ``kind``."""
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(PATTERN, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?){0,3}\)", text), text


@pytest.fixture(scope="module",
                params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    if request.param == "tiny":
        return load_model("random:tiny")
    # The default 8-bit activations: a row's bits do not depend on its step's other rows, so
    # batch composition does not move a greedy token.
    return load_model("smollm2")


def chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode_prompt(None, [{"role": "user", "content": text}])


def prompt(loaded: LoadedModel, key: str) -> list[int]:
    if loaded.source.kind == "random":  # a random model reads any ids: distinct per request
        start = zlib.crc32(key.encode()) % 200
        return [start + i for i in range(12 + len(key))]
    return chat_ids(loaded, PROMPTS[key])


def mixed_requests(loaded: LoadedModel) -> list[EngineRequest]:
    """Each format greedy and seeded, beside free requests; some ask for logprobs."""
    out = []
    limit = max_tokens(loaded)
    for n, kind in enumerate(FORMATS):
        fmt = FORMATS[kind]
        out.append(EngineRequest(f"{kind}-greedy", prompt(loaded, kind), SamplingParams(
            max_tokens=limit, response_format=fmt, logprobs=2 if kind == "regex" else None)))
        out.append(EngineRequest(f"{kind}-seeded", prompt(loaded, kind), SamplingParams(
            max_tokens=limit, temperature=0.8, top_p=0.95, seed=10 + n,
            response_format=fmt, logprobs=1 if kind == "schema" else None)))
    out.append(EngineRequest("free-greedy", prompt(loaded, "free"), SamplingParams(
        max_tokens=24, ignore_eos=True, logprobs=3)))
    out.append(EngineRequest("free-seeded", prompt(loaded, "free2"), SamplingParams(
        max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)))
    return out


def make_engine(loaded: LoadedModel, *, overlapped: bool = False, num_blocks: int = 128
                ) -> Engine:
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=64,
        num_blocks=num_blocks, async_output=overlapped, async_scheduling=overlapped))
    assert engine.async_scheduling is overlapped
    return engine


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for req in requests:
        engine.check_request(req)
        engine.add_request(req)
    return run_all(engine, max_steps=2000)


Summary = tuple[list[int], str, str | None, str, list[Any], list[tuple[int, int]]]


def summary(outs: dict[str, list[RequestOutput]]) -> dict[str, Summary]:
    return {rid: ([o.token_id for o in os_ if o.token_id is not None],
                  "".join(o.text for o in os_), os_[-1].finish_reason, os_[-1].output_text,
                  [o.logprobs for o in os_], [(o.index, o.num_output_tokens) for o in os_])
            for rid, os_ in outs.items()}


def assert_same(got: Summary, expected: Summary, rid: str) -> None:
    """Tokens, text, end and indices exactly; logprobs to float32 rounding (a different batch
    around a request moves its logits by an ulp or so)."""
    assert (got[:4], got[5]) == (expected[:4], expected[5]), rid
    assert len(got[4]) == len(expected[4]), rid
    for a, b in zip(got[4], expected[4], strict=True):
        assert (a is None) == (b is None), rid
        if a is not None and b is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), rid
            assert [t for t, _ in a.top] == [t for t, _ in b.top], rid
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def tight_blocks(loaded: LoadedModel) -> int:
    """A KV cache that holds the longest request and little more: requests preempt."""
    longest = max(len(r.prompt_ids) + r.params.max_tokens for r in mixed_requests(loaded))
    return -(-longest // 16) + 1


@pytest.fixture(scope="module")
def baseline(loaded: LoadedModel) -> dict[str, list[RequestOutput]]:
    """The plain engine's outputs of the mixed batch, with room for everything."""
    engine = make_engine(loaded)
    outs = run(engine, mixed_requests(loaded))
    assert engine.stats.preemptions == 0
    assert engine.grammars.stats.fills > 0
    assert len(engine.grammars) == 0  # every matcher dropped with its request
    return outs


def test_every_constrained_output_is_what_its_format_says(
        loaded: LoadedModel, baseline: dict[str, list[RequestOutput]]) -> None:
    assert set(baseline) == {r.request_id for r in mixed_requests(loaded)}
    for rid, (tokens, text, reason, output_text, _, _) in summary(baseline).items():
        kind = rid.split("-")[0]
        if kind == "free":
            assert reason == "length" and len(tokens) == 24
            continue
        # Every grammar here closes: the request stops there, before max_tokens.
        assert reason == "stop", (rid, output_text)
        assert len(tokens) < max_tokens(loaded)
        assert text == output_text
        conforms(kind, output_text)


def test_greedy_json_stops_when_the_document_closes(
        loaded: LoadedModel, baseline: dict[str, list[RequestOutput]]) -> None:
    eos = loaded.tokenizer.eos_token_ids
    done = summary(baseline)
    for rid in ("schema-greedy", "object-greedy", "choice-greedy", "lark-greedy"):
        tokens, _, reason, text, _, _ = done[rid]
        assert reason == "stop" and len(tokens) < max_tokens(loaded), rid
        # These grammars end at their last character: no end-of-sequence token is generated.
        assert not eos.intersection(tokens), rid
        assert loaded.tokenizer.decode(tokens) == text


def test_free_requests_get_what_they_get_alone(
        loaded: LoadedModel, baseline: dict[str, list[RequestOutput]]) -> None:
    expected = summary(baseline)
    for req in mixed_requests(loaded):
        if req.request_id.startswith("free"):
            alone = summary(run(make_engine(loaded), [req]))
            assert_same(alone[req.request_id], expected[req.request_id], req.request_id)


@pytest.mark.parametrize(("overlapped", "tight"),
                         [(True, False), (False, True), (True, True)],
                         ids=["overlapped", "preempting", "overlapped-preempting"])
def test_every_engine_gives_every_request_the_same_output(
        loaded: LoadedModel, baseline: dict[str, list[RequestOutput]], overlapped: bool,
        tight: bool) -> None:
    engine = make_engine(loaded, overlapped=overlapped,
                         num_blocks=tight_blocks(loaded) if tight else 128)
    got = summary(run(engine, mixed_requests(loaded)))
    expected = summary(baseline)
    assert set(got) == set(expected)
    for rid in expected:
        assert_same(got[rid], expected[rid], rid)
    assert len(engine.grammars) == 0
    if tight:
        assert engine.stats.preemptions > 0
    if overlapped:  # steps with constrained rows were launched ahead and sampled deferred
        assert engine.stats.scheduled_ahead > 0


@pytest.mark.parametrize("overlapped", [False, True], ids=["plain", "overlapped"])
def test_a_resumed_request_finishes_with_the_same_text(
        loaded: LoadedModel, baseline: dict[str, list[RequestOutput]], overlapped: bool) -> None:
    """Each request continued from the first half of its tokens (every engine gives the
    baseline's outputs: the test above)."""
    resumed = []
    for req in mixed_requests(loaded):
        kept = baseline[req.request_id][:len(baseline[req.request_id]) // 2]
        if kept:
            resumed.append(EngineRequest(
                req.request_id, req.prompt_ids, req.params,
                output_ids=tuple(o.token_id for o in kept if o.token_id is not None),
                output_text="".join(o.text for o in kept)))
    assert len(resumed) >= len(FORMATS)
    again = run(make_engine(loaded, overlapped=overlapped), resumed)
    for req in resumed:
        whole, rest = baseline[req.request_id], again[req.request_id]
        cut = len(req.output_ids)
        assert rest[-1].output_text == whole[-1].output_text, req.request_id
        assert rest[-1].finish_reason == whole[-1].finish_reason
        assert [o.token_id for o in rest] == [o.token_id for o in whole[cut:]]
        assert [o.index for o in rest] == list(range(cut, len(whole)))


def test_an_aborted_constrained_request_drops_its_grammar(loaded: LoadedModel) -> None:
    engine = make_engine(loaded, overlapped=True)
    params = SamplingParams(max_tokens=max_tokens(loaded),
                            response_format=FORMATS["schema"])
    engine.add_request(EngineRequest("a", prompt(loaded, "schema"), params))
    engine.add_request(EngineRequest("b", prompt(loaded, "object"), params))
    outs: list[RequestOutput] = []
    for _ in range(3):
        outs += engine.step()
    assert "a" in engine.grammars
    engine.abort("a")
    while engine.has_unfinished():
        outs += engine.step()
    ends = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert ends == {"a": "cancelled", "b": "stop"}
    assert len(engine.grammars) == 0


# ---------------------------------------------------------------- refused before running


def test_a_format_that_cannot_be_compiled_is_a_request_error() -> None:
    loaded = load_model("random:tiny")
    engine = make_engine(loaded)
    # Built without validation (as from a trusted source): the engine still checks it.
    bad_regex = SamplingParams().model_copy(update={
        "response_format": RegexFormat.model_construct(type="regex", pattern="(ab")})
    # Valid Lark, but this tokenizer has no such special token.
    no_token = SamplingParams(response_format=GrammarFormat(
        grammar='start: "a" <|no_such_token|>'))
    assert validation_error(lark_grammar('start: "a" <|no_such_token|>')) == ""
    for params, match in ((bad_regex, r"response_format\.pattern"),
                          (no_token, "response_format: .*no_such_token")):
        request = EngineRequest("bad", [10, 11, 12], params)
        with pytest.raises(RequestError, match=match):
            engine.check_request(request)
        with pytest.raises(RequestError, match=match):
            engine.add_request(request)
        assert not engine.has_unfinished() and engine.num_active == 0
        assert "bad" not in engine.grammars


def breaking_resume(loaded: LoadedModel) -> EngineRequest:
    """A continued request whose tokens so far ("purple") are none of its choices."""
    params = SamplingParams(max_tokens=50, response_format=FORMATS["choice"])
    ids = loaded.tokenizer.backend.encode("purple", add_special_tokens=False).ids
    return EngineRequest("r", prompt(loaded, "choice"), params, output_ids=tuple(ids),
                         output_text="purple")


def test_resumed_tokens_that_break_the_grammar_are_a_resume_error() -> None:
    loaded = load_model("random:tiny")
    with pytest.raises(ResumeError):
        make_engine(loaded).check_request(breaking_resume(loaded))


def test_adding_resumed_tokens_that_break_the_grammar_leaves_nothing_behind() -> None:
    loaded = load_model("random:tiny")
    engine = make_engine(loaded)
    with pytest.raises(RequestError):
        engine.add_request(breaking_resume(loaded))
    assert not engine.has_unfinished() and engine.num_active == 0
