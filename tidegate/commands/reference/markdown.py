"""Small Markdown pieces the generated reference pages share."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence


def page_head(title: str, source: str, intro: str) -> list[str]:
    """A generated page's first lines: its title, where it comes from, what it holds."""
    return [f"# {title}", "", '!!! note "Generated"',
            f"    This page is generated from {source} when the site is built; edit the code, "
            "not the page.", "", intro, ""]


def cell(text: object) -> str:
    """Text safe inside a table cell: one line, pipes escaped outside code spans (inside one,
    the table reads a pipe as text, and a backslash would show)."""
    parts = re.split(r"(`+[^`]*`+)", " ".join(str(text).split()))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|")
                   for part in parts)


def code(text: object) -> str:
    """Inline code, with enough backticks for text that holds some."""
    raw = str(text)
    fence = "``" if "`" in raw else "`"
    pad = " " if raw.startswith("`") or raw.endswith("`") else ""
    return f"{fence}{pad}{raw}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def sentence(text: str) -> str:
    """A description on one line, ending with a full stop (its first word is left as written:
    many start with a value, ``cpu`` or ``auto``)."""
    text = " ".join(text.split())
    return text if not text or text.endswith((".", "!", "?")) else text + "."
