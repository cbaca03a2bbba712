"""The JSON schema fixtures (``tests/fixtures/json_schemas.json``) are what they claim to be.

Other tests and the grammar engine benchmark (``benchmarks/engine/grammar_engines.py``) run requests
under these schemas and teacher-force their examples, so each fixture must hold together: its
example is valid JSON Schema-wise, its schema compiles to an llguidance grammar, and the example,
written compactly as our grammars write JSON, is accepted token by token on the default model's
tokenizer (the tokenization a real request would go through, not just the characters).

A random-weights model is also run under them, and it stops only where the grammar makes it:
so every string is bounded (maxLength <= 60, an enum, a const, a fixed-length format or a pattern), every
array has maxItems <= 5, every number both bounds, and no object takes keys of unbounded names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer
from tidegate.structured.grammar import json_schema_grammar, validation_error

FIXTURES_PATH = Path(__file__).resolve().parents[2] / "fixtures" / "json_schemas.json"
FIXTURES: list[dict[str, Any]] = json.loads(FIXTURES_PATH.read_text(encoding="utf-8"))
NAMES = [fixture["name"] for fixture in FIXTURES]


def compact(example: Any) -> str:
    """The example as the grammar writes JSON (``JSON_OPTIONS``): ", " and ": ", nothing else."""
    return json.dumps(example, separators=(", ", ": "), ensure_ascii=False)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model())


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    # Built as worker/engine/grammar_masks.py builds it, so the masks tested are the served ones.
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                  eos_token=sorted(tokenizer.eos_token_ids))


def test_enough_fixtures_with_unique_names() -> None:
    assert len(FIXTURES) >= 50
    assert len(set(NAMES)) == len(NAMES)
    for fixture in FIXTURES:
        assert set(fixture) == {"name", "schema", "example"}, fixture.get("name")
        # Tests send the name as json_schema.name, which OpenAI's pattern bounds.
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fixture["name"]), fixture["name"]
        assert isinstance(fixture["schema"], dict)


def unbounded_parts(schema: Any, path: str = "schema") -> list[str]:
    """Where a model that never chooses to stop could write on forever (or past ~400 chars)."""
    if not isinstance(schema, dict):
        return []
    found: list[str] = []
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    # Only these formats have a fixed length; a time's fraction, a URI or an email run on.
    bounded_string = (schema.keys() & {"enum", "const", "pattern"}
                      or schema.get("format") in ("date", "uuid", "ipv4"))
    if "string" in types and not bounded_string and schema.get("maxLength", 1_000) > 60:
        found.append(f"{path}: a string without maxLength <= 60")
    if "array" in types and schema.get("maxItems", 1_000) > 5 and schema.get("items") is not False:
        found.append(f"{path}: an array without maxItems <= 5")
    if {"number", "integer"} & set(types) and not (
            schema.keys() & {"minimum", "exclusiveMinimum"}
            and schema.keys() & {"maximum", "exclusiveMaximum"}):
        found.append(f"{path}: a number without both bounds")
    if "object" in types and schema.get("additionalProperties", True) is not False:
        found.append(f"{path}: an object open to keys of any name")
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            for name, sub in value.items():
                found += unbounded_parts(sub, f"{path}.{key}.{name}")
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            for i, sub in enumerate(value):
                found += unbounded_parts(sub, f"{path}.{key}.{i}")
        elif isinstance(value, dict):
            found += unbounded_parts(value, f"{path}.{key}")
    return found


@pytest.mark.parametrize("fixture", FIXTURES, ids=NAMES)
def test_bounded_for_a_random_model(fixture: dict[str, Any]) -> None:
    assert unbounded_parts(fixture["schema"]) == []
    assert len(compact(fixture["example"])) < 400


@pytest.mark.parametrize("fixture", FIXTURES, ids=NAMES)
def test_example_is_valid(fixture: dict[str, Any]) -> None:
    validator_class = jsonschema.Draft202012Validator
    validator_class.check_schema(fixture["schema"])
    # Formats whose checker needs a package not installed here (date-time, uri) pass unchecked;
    # the token-by-token test below checks them against llguidance's own format grammars.
    validator = validator_class(fixture["schema"], format_checker=validator_class.FORMAT_CHECKER)
    errors = [error.message for error in validator.iter_errors(fixture["example"])]
    assert not errors


@pytest.mark.parametrize("fixture", FIXTURES, ids=NAMES)
def test_schema_compiles(fixture: dict[str, Any]) -> None:
    assert validation_error(json_schema_grammar(fixture["schema"])) == ""


@pytest.mark.parametrize("fixture", FIXTURES, ids=NAMES)
def test_example_accepted_token_by_token(
    fixture: dict[str, Any], tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    text = compact(fixture["example"])
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    matcher = llguidance.LLMatcher(ll_tokenizer, json_schema_grammar(fixture["schema"]),
                                   log_level=0)
    for position, token in enumerate(ids):
        assert matcher.consume_token(token), (
            f"token {position} refused after {tokenizer.backend.decode(ids[:position])!r}: "
            f"{matcher.get_error()}")
    assert matcher.is_accepting(), f"{text!r} is not a complete instance"
