"""Prompt-lookup drafts: exact, against a brute-force search."""

from __future__ import annotations

import random

import pytest

from tidegate.worker.speculative.ngram_proposer import NgramIndex


def brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The continuation of the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences followed by a token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_a_quoted_span_is_proposed() -> None:
    index = NgramIndex(2, 3)
    index.extend([5, 6, 7, 8, 9, 1, 2, 6, 7])
    assert index.propose(3) == [8, 9, 1]
    assert index.propose(1) == [8]


def test_the_longest_then_the_latest_match_wins() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 40, 2, 3, 50, 9, 3])
    assert index.propose(2) == [50, 9]  # "3" last followed by 50 (n=1; no longer match)
    index.extend([1, 2, 3])
    assert index.propose(2) == [40, 2]  # "1 2 3" matched at the start (n=3)


def test_no_match_no_draft() -> None:
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == []
    assert NgramIndex().propose(3) == []


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_as_tokens_arrive(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    index = NgramIndex(2, 4)
    index.extend(tokens[:1])
    for i in range(1, len(tokens)):
        index.extend([tokens[i]])
        assert index.propose(3) == brute(tokens[: i + 1], 3, 2, 4), tokens[: i + 1]


def test_truncate_forgets_rejected_tokens() -> None:
    index = NgramIndex(2, 2)
    index.extend([1, 2, 3, 1, 2, 9, 9])
    index.truncate(5)
    assert index.tokens == [1, 2, 3, 1, 2]
    assert index.propose(2) == [3, 1]
