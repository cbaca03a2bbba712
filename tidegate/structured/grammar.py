"""``response_format`` -> the llguidance grammar that enforces it, checked before a job is queued.

llguidance (no torch, no other dependency) is the grammar engine: it compiles JSON schemas,
regular expressions and Lark grammars (GBNF is translated to Lark) and, in the worker, computes
each step's token mask. ``grammar_of`` gives a format's grammar, ``check_format`` refuses one that does
not compile with a ``GrammarError`` naming the part at fault (for a JSON schema, the smallest
sub-schema that fails on its own). Both are cached per format, so a service sending the same
schema with every job compiles it once per process.

JSON is written compactly, as OpenAI's models write it (``", "`` and ``": "`` between items,
no other whitespace): flexible whitespace lets a weak model pad with newlines until
``max_tokens``, and the output stays one line.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark
from pydantic import TypeAdapter

from tidegate.structured.response_format import (
    ChoiceFormat,
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    RegexFormat,
    ResponseFormat,
    TextFormat,
)

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FORMAT: TypeAdapter[ResponseFormat] = TypeAdapter(ResponseFormat)
# Keywords whose values are sub-schemas: one, a list of them, or a name -> schema mapping.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then",
        "else", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")


class GrammarError(ValueError):
    """A format the grammar engine cannot compile; ``path``: the field at fault, dotted from
    ``response_format``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def grammar_of(fmt: ResponseFormat | None) -> str | None:
    """The llguidance grammar enforcing ``fmt``; None for free text. Raises ``GrammarError``."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    return _compiled(fmt.model_dump_json())


def check_format(fmt: ResponseFormat | None) -> None:
    """Raise ``GrammarError`` if ``fmt`` does not compile."""
    grammar_of(fmt)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A JSON schema's grammar, compact JSON (``JSON_OPTIONS``)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def validation_error(grammar: str) -> str:
    """What llguidance says is wrong with a grammar; empty when it compiles."""
    return llguidance.LLMatcher.validate_grammar(grammar)


@lru_cache(maxsize=1024)
def _compiled(fmt_json: str) -> str:
    fmt = _FORMAT.validate_json(fmt_json)
    if isinstance(fmt, JsonObjectFormat):
        return json_schema_grammar({"type": "object"})
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        grammar = _json_or_error(schema, "json_schema.schema")
        if error := validation_error(grammar):
            raise GrammarError(_rejected_part(schema, "json_schema.schema"), error)
        return grammar
    if isinstance(fmt, RegexFormat):
        grammar = llguidance.LLMatcher.grammar_from_regex(fmt.pattern)
        return _checked(grammar, "pattern")
    if isinstance(fmt, ChoiceFormat):
        return _checked(lark_grammar("start: " + " | ".join(map(json.dumps, fmt.choices))),
                        "choices")
    assert isinstance(fmt, GrammarFormat)
    text = fmt.grammar
    if fmt.syntax == "gbnf":
        try:
            text = any_to_lark(text)
        except Exception as exc:  # the translator raises plain exceptions on bad GBNF
            raise GrammarError("grammar", f"not valid GBNF: {exc}") from exc
    return _checked(lark_grammar(text), "grammar")


def _checked(grammar: str, path: str) -> str:
    if error := validation_error(grammar):
        raise GrammarError(path, error)
    return grammar


def _json_or_error(schema: Any, path: str) -> str:
    try:
        return json_schema_grammar(schema)
    except ValueError as exc:
        raise GrammarError(path, str(exc)) from exc


def _rejected_part(schema: dict[str, Any], path: str,
                   defs: dict[str, Any] | None = None) -> str:
    """The deepest sub-schema of ``schema`` that fails to compile on its own (with the root's
    definitions beside it, so references still resolve): where a user should look."""
    if defs is None:
        defs = {k: schema[k] for k in ("$defs", "definitions")
                if isinstance(schema.get(k), dict)}
    for sub_path, sub in _children(schema, path):
        if not isinstance(sub, dict) or sub.keys() <= {"$defs", "definitions"}:
            continue
        alone = {**defs, **sub}
        try:
            failed = bool(validation_error(json_schema_grammar(alone)))
        except ValueError:
            failed = True
        if failed:
            return _rejected_part(sub, sub_path, defs)
    return path


def _children(schema: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            out.append((f"{path}.{key}", schema[key]))
    for key in _LIST:
        if isinstance(schema.get(key), list):
            out += [(f"{path}.{key}.{i}", s) for i, s in enumerate(schema[key])]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            out += [(f"{path}.{key}.{name}", s) for name, s in schema[key].items()]
    return out
