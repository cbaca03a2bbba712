"""``NgramIndex``: prompt-lookup drafts for one request, no extra model.

The request's tokens so far (prompt, then output) are indexed by their n-grams: for every
n-gram with a token after it, the position of that token in its latest occurrence. A draft is
what followed the latest earlier occurrence of the request's last n tokens, the longest n that
has one first: text that quotes its input (summaries, edits, code) repeats what it read, and
the draft is that repetition. Torch-free: updated by each token appended (one dict write per
n), proposed from in one dict read per n.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> where the token after its latest occurrence stands in ``tokens``
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens; every n-gram now followed by one is indexed (latest wins)."""
        for token in tokens:
            end = len(self.tokens)  # the new token's position: what follows the n-grams
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def truncate(self, length: int) -> None:
        """Forget tokens from ``length`` on (drafts rejected after being indexed): rebuilt
        from the kept tokens, which is rare."""
        if length >= len(self.tokens):
            return
        kept = self.tokens[:length]
        self.tokens, self._next = [], {}
        self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (none when the last tokens never occurred before)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []
