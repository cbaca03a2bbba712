"""Close reasons: at most 123 UTF-8 bytes (RFC 6455's limit), cut on a character boundary."""

from __future__ import annotations

import pytest

from tidegate.events.ws_relay import MAX_CLOSE_REASON_BYTES, close_reason


@pytest.mark.parametrize("reason", [
    "", "done", "x" * 200, "ü" * 100, "a" + "€" * 60, "🦀" * 40, "x" * 122 + "é",
    "lone \ud800 surrogate " * 10,
])
def test_close_reasons_fit_123_bytes_on_a_character_boundary(reason: str) -> None:
    cut = close_reason(reason)
    encoded = cut.encode()  # encodes: no lone surrogate is left
    assert len(encoded) <= MAX_CLOSE_REASON_BYTES == 123
    if len(reason.encode("utf-8", "replace")) <= 123:
        assert cut == reason.encode("utf-8", "replace").decode()
    else:  # the longest prefix that fits: one more character would not
        assert reason.encode("utf-8", "replace").startswith(encoded)
        assert len(encoded) > 123 - 4
