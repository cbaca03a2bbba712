"""Incremental detokenization never splits a character and never leaks past a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.detokenizer import IncrementalDetokenizer


class ByteDecoder:
    """A byte-level vocabulary: token i is byte i (as byte-level BPE falls back to)."""

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: str, stop: Sequence[str] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(ByteDecoder(), stop)
    pieces = []
    for b in text.encode():
        pieces.append(detok.push(b))
        if detok.stopped:
            break
    return pieces, detok


def test_multibyte_characters_are_released_whole() -> None:
    pieces, detok = feed("héllo 👋 wörld")
    assert "".join(pieces) + detok.flush() == "héllo 👋 wörld"
    assert all("\ufffd" not in p for p in pieces)
    # The four bytes of the emoji release nothing until the last one.
    emoji_at = len("héllo ".encode())
    assert pieces[emoji_at : emoji_at + 3] == ["", "", ""] and pieces[emoji_at + 3] == "👋"


def test_stop_string_truncates_and_nothing_after_it_is_released() -> None:
    pieces, detok = feed("The answer is Paris.\nUser: more", stop=["\nUser:"])
    assert detok.stopped
    assert "".join(pieces) == "The answer is Paris."
    assert detok.text == "The answer is Paris." and detok.flush() == ""


def test_partial_stop_prefix_is_held_then_released_when_it_diverges() -> None:
    pieces, detok = feed("a\nUsual", stop=["\nUser:"])
    assert not detok.stopped
    # "\nUs" is held while it could still become "\nUser:", then released at "a".
    assert pieces[1:4] == ["", "", ""]
    assert "".join(pieces) + detok.flush() == "a\nUsual"


def test_earliest_of_several_stop_strings_wins() -> None:
    pieces, detok = feed("one two three", stop=["three", "two"])
    assert detok.text == "one " and detok.stopped
