"""``tidegate.untrusted_json``: a client's JSON is parsed or refused with the field and the
reason, whatever it holds; nothing else is ever raised."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.untrusted_json import MAX_DEPTH, BadJSON, parse


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_plain_body_parses_as_json_loads_does() -> None:
    raw = '{"prompt": "héllo \\u00e9", "stop": ["\\n"], "n": 1, "x": [1.5, null, true]}'
    assert parse(raw) == json.loads(raw) == parse(raw.encode())


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 999, 100_000])
def test_nesting_past_the_limit_names_the_body(depth: int) -> None:
    with pytest.raises(BadJSON) as caught:
        parse(nested(depth))
    assert caught.value.reason == f"nested deeper than {MAX_DEPTH} levels"


def test_nesting_at_the_limit_parses() -> None:
    assert parse(nested(MAX_DEPTH)) is not None


def test_deep_nesting_inside_a_field_names_the_field_path() -> None:
    with pytest.raises(BadJSON) as caught:
        parse('{"messages": [{"content": ' + nested(200) + "}]}")
    assert caught.value.field.startswith("messages.0.content")


@pytest.mark.parametrize("raw, field", [
    (b'{"stop": ["\\ud800"]}', "stop.0"),
    (b'{"prompt": "ok", "messages": [{"content": "a\\udfffb"}]}', "messages.0.content"),
    (b'{"\\ud83d": 1}', "body"),  # a key: named by where it sits
    (b'{"stop": ["\xed\xa0\x80"]}', "stop.0"),  # raw surrogate bytes: json.loads lets them in
    (b'"\\udc00"', "body"),
])
def test_a_lone_surrogate_anywhere_names_its_field(raw: bytes, field: str) -> None:
    with pytest.raises(BadJSON) as caught:
        parse(raw)
    assert caught.value.field == field and "lone surrogate" in caught.value.reason


def test_a_surrogate_pair_is_text() -> None:
    assert parse(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("raw", ["NaN", '{"t": Infinity}', "-Infinity", "", "{", "\xff",
                                 b"\xff\xfe{", "1" * 5000, '{"a": 1} x'])
def test_what_is_not_json_names_the_body(raw: str | bytes) -> None:
    with pytest.raises(BadJSON) as caught:
        parse(raw)
    assert caught.value.field == "body" and caught.value.reason.startswith("not valid JSON")


@given(st.one_of(st.text(), st.binary()))
def test_any_input_parses_or_is_refused_with_bad_json(raw: str | bytes) -> None:
    try:
        document = parse(raw)
    except BadJSON as exc:
        assert exc.field and exc.reason
    else:
        json.dumps(document, ensure_ascii=False).encode()  # whatever parsed can be sent back


def test_a_long_key_is_named_shortened() -> None:
    with pytest.raises(BadJSON) as caught:
        parse(json.dumps({"k" * 10_000: ["\ud800"]}))
    assert caught.value.field == "k" * 200 + "..."
