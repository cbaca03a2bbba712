"""The API keys file (``TIDEGATE_API_KEYS_FILE``): one key a line, ``#`` comment lines, and
optionally the key's own rate limits after it as ``name=value`` words::

    # the ops team: the settings' default limits
    tg-ops-3f9c1e7a5b2d4f60
    tg-acme-8d2b6f0a4c1e3b5d  requests_per_s=5 tokens_per_min=40000
    tg-batchy-0a4c1e3b5d7f9a0c  tokens_per_min=unlimited
    tg-root-5e1a9c3f7b2d4e6a  admin

A line holding only a key means what it always did. The word ``admin`` lets the key call the
admin routes too (``POST /v1/adapters``). A limit left out takes its default from
the settings (``TIDEGATE_RATE_LIMIT_*``); ``unlimited`` lifts it for that key. A malformed line
is refused at start-up naming its line number, never the key. Plain Python, no I/O but a read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

# Limits a key's line may set.
LIMIT_NAMES = ("requests_per_s", "tokens_per_min")
UNLIMITED = math.inf
ADMIN_WORD = "admin"


class KeyFileError(ValueError):
    """A keys-file line that is not ``<key> [name=value ...]``: the message names the line."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One key's own limits: None takes the settings' default, ``UNLIMITED`` lifts the limit."""

    requests_per_s: float | None = None
    tokens_per_min: float | None = None


@dataclass(frozen=True, slots=True)
class KeyEntry:
    key: str
    limits: KeyLimits = KeyLimits()
    admin: bool = False  # may call the admin routes

    def __repr__(self) -> str:  # never the key, should an entry end up in a log or a traceback
        return f"KeyEntry(key=<redacted>, limits={self.limits!r}, admin={self.admin})"


def read_key_file(path: str | Path) -> list[KeyEntry]:
    """Every key of the file, in order, with its limits; ``KeyFileError`` on a bad line."""
    return parse_key_lines(Path(path).read_text())


def parse_key_lines(text: str) -> list[KeyEntry]:
    entries: list[KeyEntry] = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        admin = ADMIN_WORD in words[1:]
        rest = [w for w in words[1:] if w != ADMIN_WORD]
        if words[1:].count(ADMIN_WORD) > 1:
            raise KeyFileError(f"keys file line {number}: {ADMIN_WORD} is given twice")
        entries.append(KeyEntry(words[0], _limits(rest, number), admin))
    return entries


def _limits(words: list[str], number: int) -> KeyLimits:
    values: dict[str, float] = {}
    for place, word in enumerate(words, start=2):
        name, sep, raw = word.partition("=")
        if not sep or name not in LIMIT_NAMES:
            # The word is not quoted: it may be part of a key someone wrote with a space.
            raise KeyFileError(f"keys file line {number}, word {place}: after the key only "
                               f"{' and '.join(n + '=N' for n in LIMIT_NAMES)} or "
                               f"{ADMIN_WORD} may follow")
        if name in values:
            raise KeyFileError(f"keys file line {number}: {name} is given twice")
        values[name] = _value(name, raw, number)
    return KeyLimits(**values)


def _value(name: str, raw: str, number: int) -> float:
    if raw.lower() == "unlimited":
        return UNLIMITED
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise KeyFileError(f"keys file line {number}: {name} must be a number > 0 or "
                           f"'unlimited', not {raw[:32]!r}")
    return value
