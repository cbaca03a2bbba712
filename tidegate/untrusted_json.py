"""JSON that a client sent (HTTP bodies, WebSocket frames, batch lines): ``parse`` returns the
document or raises ``BadJSON`` naming the field and the reason, and never raises anything else.

``json.loads`` alone lets three kinds of hostile input through to fail later, as a 500 or a
dropped socket: nesting deep enough to raise ``RecursionError`` (in the parser, or afterwards
in pydantic, ``json.dumps`` or any walk over the document); strings holding a lone surrogate
(``"\\ud800"``, or its raw bytes, which ``json.loads`` of bytes lets pass), which parse but
cannot be encoded as UTF-8, so a job holding one fails when it is stored or answered; and
``NaN`` / ``Infinity``, which are not JSON. Every string, keys included, is checked here, so
each route's validation sees only text it can store and send back.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Far deeper than any request body or frame tidegate takes (a chat message's content parts are
# at depth 4), far shallower than what Python's recursion limit lets the parser reach.
MAX_DEPTH = 64

MAX_NAME_CHARS = 200  # a field's name in an error: keys are the client's, of any length
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadJSON(ValueError):
    """A client's JSON that cannot be taken: ``field`` is a dotted path into the document
    (``"stop.0"``; the root's own name, e.g. ``"body"``, for the whole document)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def parse(raw: bytes | str, *, root: str = "body") -> Any:
    """The JSON document in ``raw``, checked (see the module docstring); ``BadJSON`` if not.

    ``root`` names the whole document in errors; fields inside it are named by their path
    alone (``"messages.0.content"``), as validation errors name them.
    """
    try:
        document = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadJSON(root, f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of over 4300 digits, NaN
        raise BadJSON(root, f"not valid JSON: {exc}") from None
    check(document, root=root)
    return document


def check(document: Any, *, root: str = "body") -> None:
    """``BadJSON`` if ``document`` (parsed JSON) nests deeper than ``MAX_DEPTH`` or holds a
    string that is not valid Unicode. Iterative: the walk itself cannot overflow the stack."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(document, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, root, path)
        elif isinstance(value, dict | list):
            if len(path) >= MAX_DEPTH:
                raise BadJSON(_name(root, path), f"nested deeper than {MAX_DEPTH} levels")
            if isinstance(value, list):
                stack.extend((item, (*path, i)) for i, item in enumerate(value))
                continue
            for key, item in value.items():
                _check_text(key, root, path)
                stack.append((item, (*path, key)))


def valid_text(text: str) -> bool:
    """Whether ``text`` can be encoded as UTF-8 (holds no lone surrogate)."""
    return text.isascii() or _SURROGATE.search(text) is None


def _check_text(text: str, root: str, path: tuple[str | int, ...]) -> None:
    if not valid_text(text):
        bad = _SURROGATE.search(text)
        assert bad is not None
        raise BadJSON(_name(root, path), f"holds a lone surrogate (U+{ord(bad.group()):04X}) at "
                      f"character {bad.start()}: text must be valid Unicode")


def _name(root: str, path: tuple[str | int, ...]) -> str:
    name = ".".join(str(part) for part in path) if path else root
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
