"""``response_format`` -> llguidance grammar (``tidegate.structured.grammar``).

Every kind of format compiles, and its grammar accepts what the format describes and refuses
the rest (fed byte by byte through a real llguidance matcher on the byte-level tokenizer: JSON
compact, schemas' bounds, regexes, choices, Lark and GBNF). A format that does not compile
raises ``GrammarError`` naming the part at fault (the deepest failing sub-schema, ``pattern``,
``grammar``); the compiled grammar is cached per format; and ``SamplingParams`` refuses a bad
format with the field path ``response_format.<part>``.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest
from pydantic import TypeAdapter, ValidationError

from tidegate.model_files.tokenizer import byte_level_tokenizer
from tidegate.protocol import SamplingParams
from tidegate.structured.grammar import (
    GrammarError,
    check_format,
    grammar_of,
    validation_error,
)
from tidegate.structured.response_format import ResponseFormat, TextFormat

FORMAT = TypeAdapter(ResponseFormat)

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
KINDS: dict[str, dict[str, Any]] = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    "regex": {"type": "regex", "pattern": r"[a-z]{2}-[0-9]+"},
    "choice": {"type": "choice", "choices": ["red", "green", "a \"quoted\" \\ one", "café"]},
    "lark": {"type": "grammar", "grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'},
    "gbnf": {"type": "grammar", "syntax": "gbnf", "grammar": 'root ::= "x" [0-9]+ ("!")?'},
}
# (kind, text, whether the whole text is a complete output of the format)
CASES = [
    ("json_object", '{"a": [1, 2], "b": {"c": null}}', True),
    ("json_object", "{}", True),
    ("json_object", "[1, 2]", False),  # an array, not an object
    ("json_object", '{"a":1}', False),  # JSON is compact: ": " between key and value
    ("json_object", '{ "a": 1}', False),  # and no other whitespace
    ("json_schema", '{"name": "Ann", "age": 41}', True),
    ("json_schema", '{"name": "Annabel", "age": 41}', False),  # longer than maxLength
    ("json_schema", '{"name": "Ann"}', False),  # "age" is required
    ("json_schema", '{"name": "Ann", "age": 41, "x": 1}', False),  # no other properties
    ("json_schema", '{"name": "Ann", "age": "41"}', False),
    ("regex", "ab-12", True),
    ("regex", "abc-1", False),
    ("regex", "ab-", False),
    ("choice", "red", True),
    ("choice", 'a "quoted" \\ one', True),
    ("choice", "café", True),
    ("choice", "gre", False),  # a prefix of a choice is not one
    ("choice", "reddish", False),
    ("lark", "(1,22,333)", True),
    ("lark", "(1,)", False),
    ("gbnf", "x12!", True),
    ("gbnf", "x!", False),
]


def fmt(spec: dict[str, Any]) -> ResponseFormat:
    return FORMAT.validate_python(spec)


@pytest.fixture(scope="module")
def byte_tokenizer() -> llguidance.LLTokenizer:
    """llguidance over the byte-level tokenizer (token id = byte value)."""
    tok = byte_level_tokenizer(64)
    return llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.backend.get_vocab_size(),
                                  eos_token=sorted(tok.eos_token_ids))


def matches(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Whether ``text``, byte by byte, is a complete output under ``grammar``."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_compiles(kind: str) -> None:
    grammar = grammar_of(fmt(KINDS[kind]))
    assert isinstance(grammar, str) and grammar
    assert validation_error(grammar) == ""
    check_format(fmt(KINDS[kind]))


def test_free_text_has_no_grammar() -> None:
    assert grammar_of(None) is None
    assert grammar_of(TextFormat()) is None
    assert grammar_of(fmt({"type": "text"})) is None
    check_format(None)


@pytest.mark.parametrize(("kind", "text", "complete"), CASES,
                         ids=[f"{k}-{'ok' if c else 'refused'}-{i}"
                              for i, (k, _, c) in enumerate(CASES)])
def test_each_grammar_accepts_what_its_format_describes(
        byte_tokenizer: llguidance.LLTokenizer, kind: str, text: str, complete: bool) -> None:
    grammar = grammar_of(fmt(KINDS[kind]))
    assert grammar is not None
    assert matches(byte_tokenizer, grammar, text) is complete


def test_an_accepted_json_schema_output_validates_against_its_schema(
        byte_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = grammar_of(fmt(KINDS["json_schema"]))
    assert grammar is not None
    for text in (t for k, t, complete in CASES if k == "json_schema" and complete):
        assert matches(byte_tokenizer, grammar, text)
        jsonschema.validate(json.loads(text), PERSON)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


BAD_FORMATS = [
    pytest.param(schema_format({
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {
            "ok": {"type": "string"},
            "b": {"type": "string", "format": "no-such-format"}}}}}),
        "json_schema.schema.properties.a.properties.b", "no-such-format",
        id="nested-property-unknown-format"),
    pytest.param(schema_format({
        "$defs": {"fine": {"type": "string"}, "bad": {"type": "strin"}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/bad"}, "y": {"$ref": "#/$defs/fine"}}}),
        "json_schema.schema.$defs.bad", "strin", id="bad-def"),
    pytest.param(schema_format({"type": "object",
                                "properties": {"x": {"$ref": "#/$defs/missing"}}}),
                 "json_schema.schema.properties.x", "missing", id="dangling-ref"),
    pytest.param(schema_format({"type": "array",
                                "items": {"type": "string", "pattern": "(["}}),
                 "json_schema.schema.items", "unclosed", id="bad-pattern-in-items"),
    pytest.param(schema_format({"anyOf": [{"type": "string"},
                                          {"type": "string", "pattern": "(["}]}),
                 "json_schema.schema.anyOf.1", "unclosed", id="second-anyOf-branch"),
    pytest.param(schema_format({"type": "object",
                                "additionalProperties": {"type": "strin"}}),
                 "json_schema.schema.additionalProperties", "strin",
                 id="additional-properties"),
    pytest.param({"type": "regex", "pattern": "(ab"}, "pattern", "unclosed group",
                 id="regex"),
    pytest.param({"type": "grammar", "grammar": "start: item\n"}, "grammar", "item",
                 id="lark-unknown-rule"),
    pytest.param({"type": "grammar", "grammar": 'start: "a" | ('}, "grammar", "",
                 id="lark-syntax"),
    pytest.param({"type": "grammar", "syntax": "gbnf", "grammar": 'root ::= "a" | ('},
                 "grammar", "not valid GBNF", id="gbnf-syntax"),
    pytest.param({"type": "grammar", "syntax": "gbnf", "grammar": "root ::= item"},
                 "grammar", "not valid GBNF", id="gbnf-unknown-rule"),
]


@pytest.mark.parametrize(("spec", "path", "reason"), BAD_FORMATS)
def test_errors_name_the_part_at_fault(spec: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(GrammarError) as info:
        grammar_of(fmt(spec))
    assert info.value.path == path
    assert reason in info.value.reason
    assert str(info.value).startswith(f"{path}: ")
    with pytest.raises(GrammarError):
        check_format(fmt(spec))


def test_a_valid_ref_beside_the_fault_two_levels_down_is_not_blamed() -> None:
    schema = {
        "$defs": {"name": {"type": "string"}},
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {
            "x": {"$ref": "#/$defs/name"},  # fine: the root defines it
            "y": {"type": "string", "format": "no-such-format"}}}},
    }
    with pytest.raises(GrammarError) as info:
        grammar_of(fmt(schema_format(schema)))
    assert info.value.path == "json_schema.schema.properties.a.properties.y"


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_format_gives_the_same_grammar_object(kind: str) -> None:
    # Two separately built (equal) formats: the second is served from the cache, not compiled
    # again (llguidance returns a new string every time it compiles).
    first = grammar_of(fmt(json.loads(json.dumps(KINDS[kind]))))
    second = grammar_of(fmt(json.loads(json.dumps(KINDS[kind]))))
    assert first is second


def test_different_formats_give_different_grammars() -> None:
    grammars = {grammar_of(fmt(spec)) for spec in KINDS.values()}
    assert len(grammars) == len(KINDS)
    narrower = dict(PERSON, properties={**PERSON["properties"],
                                        "name": {"type": "string", "maxLength": 4}})
    assert grammar_of(fmt(schema_format(narrower))) != grammar_of(fmt(KINDS["json_schema"]))


@pytest.mark.parametrize(("spec", "path", "reason"), BAD_FORMATS)
def test_sampling_params_refuse_a_bad_format_with_its_field_path(
        spec: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate({"response_format": spec})
    (error,) = info.value.errors()
    assert error["ctx"]["field"] == f"response_format.{path}"
    assert reason in error["msg"]


def test_sampling_params_keep_a_good_format_through_json() -> None:
    params = SamplingParams.model_validate({"response_format": KINDS["json_schema"]})
    wire = json.loads(params.model_dump_json())
    assert wire["response_format"]["json_schema"]["schema"] == PERSON  # the wire name
    again = SamplingParams.model_validate_json(params.model_dump_json())
    assert again == params
    assert grammar_of(again.response_format) is grammar_of(params.response_format)
