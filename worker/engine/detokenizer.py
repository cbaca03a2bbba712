"""Incremental detokenization with stop strings.

Text is released token by token, but never half a UTF-8 character (a byte-level BPE token can
end mid-character; its text waits for the next token) and never any text at or past a stop
string: the tail that could still grow into a stop string is held back until it can't.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        # Decode a window [prefix, read) as context so merges across tokens come out right.
        self._prefix = 0
        self._read = 0
        self._held = ""  # decoded text not yet released (could start a stop string)
        self.text = ""  # everything released so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it releases (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        if len(after) < len(before) or after.endswith(REPLACEMENT):
            return ""  # mid-character: wait for the rest of its bytes
        if len(after) == len(before):
            # A token without text (a skipped special token, an id past the vocabulary) changes
            # nothing around it either: it leaves the window, which would otherwise grow by one
            # such token at every step and make each push decode all of them again.
            self._ids.pop()
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(self._held + after[len(before) :])

    def flush(self) -> str:
        """Release whatever is held back: the request ended without meeting a stop string."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        self.text += out
        return out

    def _release(self, buf: str) -> str:
        hit = min((i for s in self._stop if (i := buf.find(s)) >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            out, self._held = buf[:hit], ""
        else:
            keep = self._partial_stop_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
