"""Whether a constrained job's output is what its JSON schema allows, checked apart from the engine.

The worker enforces ``response_format`` with llguidance; this check shares nothing with it, so
a mask applied to the wrong row, or a token the grammar should have refused, shows up here.
A job that ended on its own (``finish_reason`` "stop") must hold one whole JSON document, and
that document must satisfy the schema where ``jsonschema`` is installed (JSON syntax only
otherwise). A job cut at ``max_tokens`` ("length") holds a prefix: it must be one that some
JSON document begins with (a pushdown recogniser over RFC 8259, below); a whole document cut
exactly at the end is checked as a whole one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_WS = frozenset(" \t\n\r")
MAX_EXAMPLES = 5
# response_format types (tidegate.structured.response_format); none is a JSON schema type.
FORMAT_TYPES = frozenset({"text", "json_object", "json_schema", "regex", "choice", "grammar"})


def json_prefix_problem(text: str) -> tuple[str | None, bool]:
    """(why ``text`` cannot begin any JSON document, or None; whether it is one whole document).
    """
    stack: list[str] = []  # open containers, "{" or "["
    # value, first (a value or "]"), key_first (a key or "}"), key, colon, after (a value
    # ended: "," or a closer), done, string, number, literal
    state = "value"
    is_key = False
    escape, hex_left = False, 0
    token = ""  # the number or literal being read
    i = 0

    def ended() -> str:
        return "after" if stack else "done"

    while i < len(text):
        ch = text[i]
        at = f"at char {i} ({ch!r})"
        if state == "string":
            if hex_left:
                if ch not in _HEX:
                    return f"bad \\u escape {at}", False
                hex_left -= 1
            elif escape:
                if ch not in _ESCAPES:
                    return f"bad escape {at}", False
                escape, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                escape = True
            elif ch == '"':
                state = "colon" if is_key else ended()
            elif ord(ch) < 0x20:
                return f"raw control character in a string {at}", False
            i += 1
            continue
        if state == "number":
            if ch in "0123456789+-.eE":
                token += ch
                i += 1
                continue
            if not _NUMBER.fullmatch(token):
                return f"bad number {token!r} before char {i}", False
            state = ended()  # the character that ended it is read below
        if state == "literal":
            word = _LITERALS[token[0]]
            if ch != word[len(token)]:
                return f"bad literal {token + ch!r} {at}", False
            token += ch
            state = ended() if token == word else state
            i += 1
            continue
        i += 1
        if ch in _WS:
            continue
        if state in ("value", "first"):
            if ch in "{[":
                stack.append(ch)
                state = "key_first" if ch == "{" else "first"
            elif ch == '"':
                state, is_key = "string", False
            elif ch == "-" or ch.isdigit():
                state, token = "number", ch
            elif ch in _LITERALS:
                state, token = "literal", ch
            elif ch == "]" and state == "first":
                stack.pop()
                state = ended()
            else:
                return f"a value expected {at}", False
        elif state in ("key_first", "key"):
            if ch == '"':
                state, is_key = "string", True
            elif ch == "}" and state == "key_first":
                stack.pop()
                state = ended()
            else:
                return f"a key expected {at}", False
        elif state == "colon":
            if ch != ":":
                return f"':' expected {at}", False
            state = "value"
        elif state == "after":
            if ch == ",":
                state = "key" if stack[-1] == "{" else "value"
            elif ch == "}]"[stack[-1] == "["]:
                stack.pop()
                state = ended()
            else:
                return f"',' or {'}]'[stack[-1] == '[']!r} expected {at}", False
        else:  # done
            return f"text after the document {at}", False
    if state == "number":
        # A number cut short is a prefix if one more digit can complete it ("1e", "-", "0.").
        if not any(_NUMBER.fullmatch(token + more) for more in ("", "0")):
            return f"bad number {token!r} at the end", False
        return None, not stack
    return None, state == "done"


def schema_problem(document: Any, schema: dict[str, Any]) -> str | None:
    """Why ``document`` breaks ``schema`` (None if it holds, or if jsonschema is missing)."""
    try:
        import jsonschema
    except ImportError:
        return None
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is None:
        return None
    where = "/".join(map(str, error.absolute_path)) or "the document"
    return f"{where}: {error.message[:200]}"


def has_schema_validator() -> bool:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def output_problem(text: str, finish_reason: str | None,
                   schema: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(what is wrong with one constrained output, or None; whether it is a whole document).
    ``schema``: the json_schema format's schema; None for json_object (any object)."""
    problem, whole = json_prefix_problem(text)
    if problem is not None:
        return problem, whole
    if finish_reason == "stop" and not whole:
        return "ended before its JSON document closed", False
    if not whole:
        return None, False
    document = json.loads(text)  # the recogniser said it is whole JSON
    if schema is None:
        return (None if isinstance(document, dict) else "not a JSON object"), True
    return schema_problem(document, schema), True


def format_schema(fmt: dict[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """(whether ``fmt`` asks for JSON, the schema to check it against)."""
    if not fmt:
        return False, None
    if fmt.get("type") == "json_schema":
        return True, fmt["json_schema"]["schema"]
    return fmt.get("type") == "json_object", None


@dataclass(slots=True)
class JsonCheck:
    """A run's constrained outputs: how many were checked, whole documents, prefixes cut at
    max_tokens, and invalid ones (with a few examples)."""

    checked: int = 0
    whole: int = 0
    prefixes: int = 0
    invalid: int = 0
    schema_validated: bool = field(default_factory=has_schema_validator)
    examples: list[str] = field(default_factory=list)

    def add(self, label: str, text: str, finish_reason: str | None,
            schema: dict[str, Any] | None) -> None:
        problem, whole = output_problem(text, finish_reason, schema)
        self.checked += 1
        if problem is not None:
            self.invalid += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"{label}: {problem}")
        elif whole:
            self.whole += 1
        else:
            self.prefixes += 1

    def line(self) -> str:
        how = "JSON schema" if self.schema_validated else "JSON syntax (jsonschema missing)"
        return (f"{self.checked} JSON outputs checked ({how}): {self.whole} whole documents, "
                f"{self.prefixes} valid prefixes cut at max_tokens, {self.invalid} invalid")


def check_outputs(outputs: Iterable[tuple[str, str, str | None]],
                  formats: Sequence[dict[str, Any] | None]) -> JsonCheck:
    """``outputs``: (label, text, finish_reason) of each job, aligned with ``formats``; jobs
    whose format asks for no JSON are skipped."""
    check = JsonCheck()
    for (label, text, finish), fmt in zip(outputs, formats, strict=True):
        is_json, schema = format_schema(fmt)
        if is_json:
            check.add(label, text, finish, schema)
    return check


def formats_from_file(path: Path) -> list[dict[str, Any]]:
    """The response formats a file names, in order: one or a list of response_format objects,
    JSON schemas (each becomes a json_schema format), OpenAI-style ``{"name", "schema"}``
    entries, or a collection of any of these as ``{"schemas": [...]}`` or ``{name: item}``."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and not _is_item(data):
        data = data.get("schemas", data)
        if isinstance(data, dict):
            data = [({"name": k, **v} if isinstance(v, dict) and "schema" in v
                     else {"name": k, "schema": v}) for k, v in data.items()]
    items = data if isinstance(data, list) else [data]
    if not items:
        raise ValueError(f"{path}: no response formats")
    return [as_format(item, f"schema_{i}") for i, item in enumerate(items)]


def as_format(item: Any, default_name: str) -> dict[str, Any]:
    """One entry of ``formats_from_file`` as a response_format object."""
    if not isinstance(item, dict):
        raise ValueError(f"a response format or JSON schema must be an object, not {item!r:.80}")
    if item.get("type") in FORMAT_TYPES:
        return item
    name, schema = default_name, item
    if isinstance(item.get("schema"), dict) and "properties" not in item:
        name, schema = str(item.get("name") or default_name), item["schema"]
    # The API's name pattern: ^[A-Za-z0-9_-]{1,64}$.
    name = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or default_name
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _is_item(data: dict[str, Any]) -> bool:
    """Whether a top-level object is one format or schema rather than a collection."""
    return (data.get("type") in FORMAT_TYPES or "type" in data or "properties" in data
            or "$schema" in data or "anyOf" in data or "oneOf" in data or "$ref" in data
            or ("schema" in data and isinstance(data["schema"], dict) and "name" in data))
