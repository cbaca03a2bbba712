"""``NgramSpeculator``: each running request's prompt-lookup drafts (``NgramIndex`` per
request, kept up to date with its tokens and dropped when it finishes)."""

from __future__ import annotations

from tidegate.worker.engine.sequence import Sequence
from tidegate.worker.speculative.ngram_proposer import NgramIndex


class NgramSpeculator:
    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.num_tokens = num_tokens
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(num_tokens, limit)`` drafts after ``seq``'s tokens so far."""
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
        have = len(index.tokens)
        n = len(seq.prompt_ids)
        if have < n:
            index.extend(seq.prompt_ids[have:])
            have = n
        index.extend(seq.output_ids[have - n :])
        return index.propose(min(self.num_tokens, limit))

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """``propose`` for each (request, limit)."""
        return [self.propose(seq, limit) for seq, limit in wanted]

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
