"""Incremental detokenization never splits a character and never leaks past a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from tidegate.worker.engine.detokenizer import IncrementalDetokenizer


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


class CountingDecoder:
    """The real SmolLM2 tokenizer, recording how many ids each decode call is given."""

    def __init__(self) -> None:
        from tidegate.model_files.model_source import resolve_model
        from tidegate.model_files.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(resolve_model("smollm2"))
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int]) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids)


def test_tokens_without_text_keep_the_window_short_and_the_text_exact() -> None:
    """Skipped special tokens between text tokens release nothing, change nothing around them
    (the space before a word survives a run of them), and do not pile up in the decode window:
    a model emitting them step after step would otherwise decode them all again at every push."""
    decoder = CountingDecoder()
    tok = decoder.tokenizer
    text = "Hello wörld 👋, and the rest of it."
    ids = tok.encode(text)
    special = 1  # <|im_start|>: skipped when decoding
    assert tok.decode([special]) == ""
    detok = IncrementalDetokenizer(decoder)
    pieces = []
    for i, token in enumerate(ids):
        pieces.append(detok.push(token))
        for _ in range(200 if i == 1 else 3):
            assert detok.push(special) == ""
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == text
    # The window holds the token before the newest and, while a character is incomplete, its
    # byte tokens and the specials among them: never the run of 200.
    assert max(decoder.lengths) <= 16
    # Ids past the vocabulary (random-weight models sample them) decode to nothing as well.
    detok = IncrementalDetokenizer(decoder)
    decoder.lengths.clear()
    for _ in range(300):
        assert detok.push(tok.vocab_size + 5) == ""
    assert max(decoder.lengths) <= 1
