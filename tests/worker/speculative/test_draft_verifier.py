"""Draft verification: greedy keeps exactly plain decoding's tokens; sampling keeps the target
distribution at every position (chi-square over many seeded draws); a seed repeats itself."""

from __future__ import annotations

import pytest
import torch

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.sampler import Sampler, probabilities
from tidegate.worker.speculative.draft_verifier import DraftVerifier

# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one
# run in a thousand per check.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


class Row:
    def __init__(self, rid: str, params: SamplingParams, seed: int) -> None:
        self.request_id, self.params, self.seed = rid, params, seed
        self.prompt_ids: list[int] = [1, 2]
        self.output_ids: list[int] = []


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0],   # argmax 1
                           [3.0, 0.0, 1.0, 0.0],   # argmax 0
                           [0.0, 0.0, 0.0, 9.0]])  # argmax 3
    verifier = DraftVerifier(Sampler())
    row = Row("g", SamplingParams(temperature=0.0), 0)
    assert verifier.verify(logits, row, [1, 0]) == [1, 0, 3]  # both kept, then the bonus
    assert verifier.verify(logits, row, [1, 2]) == [1, 0]  # second missed: the argmax instead
    assert verifier.verify(logits, row, [2, 0]) == [1]
    assert verifier.verify(logits[:1], row, []) == [1]
    with pytest.raises(ValueError):
        verifier.verify(logits, row, [1])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["plain", "top-k", "top-p"])
def test_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Drafts [2, 0] against fixed logits: the first token is distributed as p_0 whatever
    the draft, and after the first draft is kept the second as p_1; over 6000 seeds."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5) * 1.5
    p = probabilities(logits, [params] * 3)
    p = p / p.sum(dim=-1, keepdim=True)
    verifier = DraftVerifier(Sampler())
    first = torch.zeros(5)
    second = torch.zeros(5)
    for seed in range(6000):
        out = verifier.verify(logits, Row(f"r{seed}", params, seed), [2, 0])
        first[out[0]] += 1
        if out[0] == 2:
            second[out[1]] += 1
    df = int((p[0] > 0).sum()) - 1
    assert chi2(first, p[0]) < CHI2_999[df], (first, p[0])
    df = int((p[1] > 0).sum()) - 1
    assert chi2(second, p[1]) < CHI2_999[df], (second, p[1])


def test_a_seed_repeats_its_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    a = DraftVerifier(Sampler()).verify(logits, Row("x", params, 7), [3, 4, 5])
    b = DraftVerifier(Sampler()).verify(logits, Row("x", params, 7), [3, 4, 5])
    assert a == b


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=3),
    SamplingParams(temperature=0.6, top_p=0.9, seed=4),
    SamplingParams(temperature=0.0),
], ids=["plain", "top-p", "greedy"])
def test_tokens_are_plain_samplings_and_the_stream_stays_in_step(params: SamplingParams) -> None:
    """Whatever the drafts, the tokens given are those plain sampling draws position by
    position with the same seed, and the request's stream is left where plain sampling
    leaves it after as many tokens: the next draw is the same too."""
    torch.manual_seed(2)
    logits = torch.randn(4, 30) * 2
    seed = params.seed or 0
    plain_sampler = Sampler()
    row = Row("p", params, seed)
    plain = [plain_sampler(logits[j : j + 1], [row]).token_ids[0] for j in range(4)]
    for draft in ([plain[0], plain[1], plain[2]],  # every draft kept
                  [plain[0], (plain[1] + 1) % 30, 0],  # the second missed
                  [(plain[0] + 1) % 30, 5, 6]):  # the first missed
        sampler = Sampler()
        verifier = DraftVerifier(sampler)
        row = Row("p", params, seed)
        tokens = verifier.verify(logits, row, draft)
        n = len(tokens)
        assert tokens == plain[:n]
        if n < 4:  # then plain sampling goes on from the same stream
            assert sampler(logits[n : n + 1], [row]).token_ids[0] == plain[n]
