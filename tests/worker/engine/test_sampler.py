"""Batched sampling: filters, penalties, logprobs, per-request seeds independent of the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    top_k_top_p_cutoff,
    two_stage_argmax,
)


@dataclass
class Row:
    """The smallest thing that satisfies ``SamplingRow``."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    seed: int = 0


def row(rid: str = "r", *, seed: int = 0, prompt: list[int] | None = None,
        output: list[int] | None = None, **params: object) -> Row:
    return Row(rid, SamplingParams.model_validate(params), prompt or [], output or [], seed)


def rows(n: int, **params: object) -> list[Row]:
    """n requests with the same params and seeds 0..n-1."""
    return [row(f"r{i}", seed=i, **params) for i in range(n)]


def sample(logits: torch.Tensor, batch: list[Row], sampler: Sampler | None = None) -> list[int]:
    return (sampler or Sampler())(logits, batch).token_ids


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in masked]


def filtered(logits: torch.Tensor, *, top_k: list[int] | None = None,
             top_p: list[float] | None = None, min_p: list[float] | None = None) -> list[set[int]]:
    """The tokens each row may still pick after the sampler's filters, in its order."""
    n, vocab = logits.shape
    cutoff = top_k_top_p_cutoff(logits, torch.tensor(top_k or [0] * n),
                                torch.tensor(top_p or [1.0] * n), vocab)
    masked = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = apply_min_p(masked.softmax(-1), torch.tensor(min_p or [0.0] * n))
    return [set(r.nonzero().flatten().tolist()) for r in probs]


# ---------------------------------------------------------------- filters


def test_greedy_and_top_k_one_are_argmax() -> None:
    logits = torch.randn(6, 50)
    assert sample(logits, rows(6)) == logits.argmax(-1).tolist()
    assert sample(logits, rows(6, temperature=1.0, top_k=1)) == logits.argmax(-1).tolist()


def test_two_stage_argmax_is_argmax_with_its_first_index_on_ties() -> None:
    """The GPU's few-row argmax (group maxima, then the first group holding the maximum) must
    pick what argmax picks, ties included: the maximum repeated within a group, across groups,
    in the first and last columns."""
    x = torch.randn(6, 64 * 5)
    x[1, [7, 9, 200]] = 10.0  # within one group and in a later one
    x[2, [0, 319]] = 10.0  # first and last columns
    x[3] = 1.0  # all equal
    x[4, 64 * 3 : 64 * 4] = 10.0  # a whole later group
    x[5, [65, 64]] = 10.0  # tied neighbours in group 1
    assert two_stage_argmax(x, 5).tolist() == x.argmax(dim=-1).tolist() == [
        x[0].argmax().item(), 7, 0, 0, 192, 64]
    for groups in (1, 2, 4, 8, 16, 64):
        y = torch.randint(0, 3, (8, 64 * 4)).float()  # many ties
        assert two_stage_argmax(y, groups).tolist() == y.argmax(dim=-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two only.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    picked = torch.tensor(sample(logits, rows(400, temperature=1.0, top_p=0.7)))
    assert set(picked.tolist()) == {0, 1}
    share0 = (picked == 0).float().mean().item()
    assert 0.55 < share0 < 0.70  # 0.5 / 0.8 renormalised = 0.625


def test_top_k_limits_the_choice() -> None:
    logits = torch.zeros(300, 10)
    logits[:, 7] = 1.0
    logits[:, 2] = 0.9
    assert set(sample(logits, rows(300, temperature=1.0, top_k=2))) == {2, 7}


def test_each_row_keeps_its_own_filters_in_a_mixed_batch() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 on every row.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(600, 1)
    kinds = [{"top_k": 1}, {"top_p": 0.7}, {"top_k": 3}, {"min_p": 0.5}, {}]
    batch = [row(f"r{i}", seed=i, temperature=1.0, **kinds[i % 5]) for i in range(600)]
    picked = sample(logits, batch)
    assert [set(picked[k::5]) for k in range(5)] == [{0}, {0, 1}, {0, 1, 2}, {0, 1}, {0, 1, 2, 3}]


def test_a_vanishing_temperature_is_greedy() -> None:
    logits = torch.randn(3, 40) * 50
    assert sample(logits, rows(3, temperature=1e-7)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46])
def test_a_top_p_that_rounds_to_zero_keeps_the_best_token(top_p: float) -> None:
    # Valid (top_p > 0), yet 0 in float32: the nucleus must still hold the best token (it
    # held none, and a gather at index -1 killed the worker; found by benchmarks/serving/fuzz.py).
    logits = torch.randn(4, 512)
    for top_k in (0, 5):
        assert sample(logits, rows(4, temperature=1.0, top_p=top_p, top_k=top_k)) == \
            logits.argmax(-1).tolist()


def test_min_p_keeps_exactly_the_tokens_with_p_at_least_min_p_times_p_max() -> None:
    # p_max 0.4, min_p 0.3: the threshold is 0.12, so 0.4, 0.2 and 0.15 stay.
    logits = torch.tensor([[0.1, 0.4, 0.08, 0.2, 0.07, 0.15]]).log()
    assert filtered(logits, min_p=[0.3]) == [{1, 3, 5}]
    assert set(sample(logits.repeat(300, 1), rows(300, temperature=1.0, min_p=0.3))) == {1, 3, 5}


def test_min_p_matches_its_definition_on_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300) * 2
    min_p = torch.rand(16)
    probs = logits.softmax(-1)
    expected = probs >= min_p[:, None] * probs.amax(-1, keepdim=True)
    assert torch.equal(apply_min_p(probs, min_p) > 0, expected)


def test_top_p_is_taken_over_the_renormalised_top_k() -> None:
    # Top-3 of 0.3, 0.25, 0.2, 0.15, 0.1 renormalises to 0.43, 0.36, 0.29: top_p 0.7 keeps 2.
    # Over the full distribution the same top_p would keep 3.
    logits = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]]).log().repeat(2, 1)
    assert filtered(logits, top_k=[3, 0], top_p=[0.7, 0.7]) == [{0, 1}, {0, 1, 2}]


def test_ranking_only_the_top_k_cuts_the_same_as_a_sort() -> None:
    torch.manual_seed(4)
    logits = torch.randn(6, 300)
    top_k = torch.tensor([0, 1, 5, 40, 3, 0])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.6, 0.9, 1.0])
    from_topk = top_k_top_p_cutoff(logits, top_k, top_p, candidates=40)
    assert torch.equal(from_topk, top_k_top_p_cutoff(logits, top_k, top_p, candidates=300))
    sizes = [len(s) for s in kept(logits.masked_fill(logits < from_topk, float("-inf")))]
    assert sizes[:3] + sizes[4:] == [300, 1, 5, 3, 300] and 1 < sizes[3] < 40


def test_filters_match_hugging_face_warpers_in_their_order() -> None:
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(1)
    logits = torch.randn(12, 500) * 3
    top_k = torch.tensor([0, 5, 50, 0, 0, 20, 0, 100, 3, 0, 0, 7])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.8, 0.95, 1.0, 1.0, 0.3, 0.99, 0.6])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.05, 0.2, 0.01, 0.0, 0.0, 0.5, 0.02])
    ours = filtered(logits, top_k=top_k.tolist(), top_p=top_p.tolist(), min_p=min_p.tolist())
    for i in range(12):
        warpers = []
        if top_k[i] > 0:
            warpers.append(logits_process.TopKLogitsWarper(int(top_k[i])))
        if top_p[i] < 1:
            warpers.append(logits_process.TopPLogitsWarper(float(top_p[i])))
        if min_p[i] > 0:
            warpers.append(logits_process.MinPLogitsWarper(float(min_p[i])))
        scores = logits[i : i + 1].clone()
        for warp in warpers:
            scores = warp(torch.zeros(1, 1, dtype=torch.long), scores)
        assert [ours[i]] == kept(scores), i


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    batch = [row(prompt=[0, 1], output=[3, 3], repetition_penalty=2.0)]
    expected = torch.tensor([[1.0, -2.0, 0.5, -6.0, 1.0, 0.0]])  # 2 and 4 were never seen
    assert torch.equal(apply_penalties(logits, batch), expected)


def test_repetition_penalty_matches_hugging_face() -> None:
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(2)
    logits = torch.randn(2, 40)
    batch = [row("a", prompt=[1, 5, 5, 9], output=[30, 1], repetition_penalty=1.3),
             row("b", prompt=[2], output=[7, 8, 7], repetition_penalty=0.7)]
    for i, r in enumerate(batch):
        hf = logits_process.RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        expected = hf(ids, logits[i : i + 1].clone())
        assert torch.allclose(apply_penalties(logits, batch)[i : i + 1], expected)


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, 6)
    batch = [row(prompt=[5, 5], output=[1, 1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)]
    # Token 1: -0.5 - 3 * 0.25; token 2: -0.5 - 0.25; token 5 is only in the prompt.
    expected = torch.tensor([[0.0, -1.25, -0.75, 0.0, 0.0, 0.0]])
    assert torch.equal(apply_penalties(logits, batch), expected)


def test_negative_presence_and_frequency_penalties_encourage_repeats() -> None:
    logits = torch.zeros(1, 4)
    batch = [row(output=[3, 3], presence_penalty=-1.0, frequency_penalty=-0.5)]
    assert torch.equal(apply_penalties(logits, batch), torch.tensor([[0.0, 0.0, 0.0, 2.0]]))


def test_repetition_penalty_comes_before_presence_and_frequency() -> None:
    logits = torch.tensor([[1.0, 3.0]])
    batch = [row(output=[0], repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)]
    assert torch.equal(apply_penalties(logits, batch), torch.tensor([[1.0 / 2 - 1 - 0.5, 3.0]]))


def test_penalties_apply_per_row_and_leave_the_input_alone() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    batch = [row("a", output=[2], presence_penalty=1.0), row("b", output=[2]),
             row("c", prompt=[0], output=[1], repetition_penalty=2.0)]
    expected = torch.tensor([[1.0, 2.0, 2.0], [1.0, 2.0, 3.0], [0.5, 1.0, 3.0]])
    assert torch.equal(apply_penalties(logits, batch), expected)
    assert torch.equal(logits, torch.tensor([[1.0, 2.0, 3.0]] * 3))


def test_greedy_rows_apply_their_penalties() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    batch = [row("a", output=[0], presence_penalty=0.5), row("b", output=[0])]
    assert sample(logits, batch) == [1, 0]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_the_raw_log_softmax_with_top_n_best_first() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    batch = [row("a", logprobs=5),
             row("b", logprobs=0, temperature=0.7, seed=4),
             row("c"),
             row("d", logprobs=3, output=[int(logits[3].argmax())], repetition_penalty=5.0)]
    out = Sampler()(logits, batch)
    reference = torch.log_softmax(logits, dim=-1)  # before penalties and temperature
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 3)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-6)
        values, ids = reference[i].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert lp.top == sorted(lp.top, key=lambda pair: -pair[1])
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy picks the best


def test_logprobs_are_finite_even_for_impossible_tokens() -> None:
    logits = torch.tensor([[0.0, float("-inf"), float("-inf")]])
    lp = Sampler()(logits, [row(logprobs=2)]).logprobs[0]
    assert lp is not None and all(math.isfinite(v) for _, v in lp.top)


# ---------------------------------------------------------------- seeds


def steps_alone(logits: torch.Tensor, r: Row) -> list[int]:
    sampler = Sampler()
    return [sampler(step[None], [r]).token_ids[0] for step in logits]


def test_same_seed_same_tokens_whatever_the_batch_over_several_steps() -> None:
    torch.manual_seed(0)
    steps, vocab = 6, 100
    mine = torch.randn(steps, vocab)
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 42}
    alone = steps_alone(mine, row("me", **params))
    assert len(set(alone)) > 1  # the generator advances from one step to the next

    sampler = Sampler()
    crowd: list[int] = []
    for step in range(steps):
        others = [row("g"), row("x", temperature=1.0, seed=1, top_k=5),
                  row("y", temperature=0.7, seed=2, min_p=0.1),
                  row("z", temperature=1.2, seed=3, presence_penalty=1.0, output=[1, 2])]
        others = others[: step % 4 + 1]
        position = step % (len(others) + 1)
        batch = others[:position] + [row("me", **params)] + others[position:]
        logits = torch.randn(len(batch), vocab)
        logits[position] = mine[step]
        crowd.append(sampler(logits, batch).token_ids[position])
    assert crowd == alone


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(8, 1000)
    a = steps_alone(logits, row(temperature=1.0, seed=1))
    b = steps_alone(logits, row(temperature=1.0, seed=2))
    assert a != b


def test_free_restarts_the_stream_of_the_same_request_id() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    r = row("same", temperature=1.0, seed=7)
    first = [sampler(logits, [r]).token_ids[0] for _ in range(4)]
    sampler.free("same")
    again = [sampler(logits, [r]).token_ids[0] for _ in range(4)]
    assert again == first
    assert [sampler(logits, [r]).token_ids[0] for _ in range(4)] != first


# ---------------------------------------------------------------- the whole batch


def test_a_mixed_batch_returns_one_token_and_logprobs_entry_per_row() -> None:
    torch.manual_seed(5)
    vocab = 64
    batch = [row("greedy"),
             row("sampled", temperature=0.8, top_p=0.9, top_k=10, seed=1),
             row("penalised", prompt=[1, 2], output=[3], repetition_penalty=1.5,
                 frequency_penalty=0.3),
             row("logprobs", temperature=1.0, min_p=0.05, seed=2, logprobs=4)]
    logits = torch.randn(len(batch), vocab)
    out = Sampler()(logits, batch)
    assert isinstance(out, SamplerOutput)
    assert len(out.token_ids) == len(out.logprobs) == 4
    assert all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.logprobs[:3] == [None, None, None]
    assert out.logprobs[3] is not None and len(out.logprobs[3].top) == 4


def test_a_launch_holds_the_chosen_tokens_before_they_are_read_back() -> None:
    # What async scheduling feeds the next step from, without reading the tokens back.
    torch.manual_seed(6)
    batch = [row("greedy"), row("sampled", temperature=0.9, seed=4, logprobs=2)]
    logits = torch.randn(2, 32)
    launched = Sampler().launch(logits, batch)
    assert launched.request_ids == ["greedy", "sampled"]
    assert launched.token_ids.dtype == torch.long
    chosen = launched.token_ids.tolist()
    out = launched()
    assert out.token_ids == chosen == Sampler()(logits, batch).token_ids
    assert out.logprobs[1] is not None and out.logprobs[1].top[0][0] == int(logits[1].argmax())


def test_an_empty_batch_samples_nothing() -> None:
    assert Sampler()(torch.zeros(0, 5), []) == SamplerOutput([], [])


def test_bad_inputs_are_named_errors() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [row()])
    with pytest.raises(ValueError, match="float32"):
        Sampler()(torch.zeros(1, 5, dtype=torch.bfloat16), [row()])
    with pytest.raises(ValueError, match="sampler works on"):
        Sampler("meta")(torch.zeros(1, 5), [row()])


@settings(max_examples=200, deadline=None)
@given(temperature=st.floats(0, 2), top_p=st.floats(0, 1, exclude_min=True),
       top_k=st.integers(0, 10**6), min_p=st.floats(0, 1),
       repetition_penalty=st.floats(0, 10, exclude_min=True),
       presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2))
def test_any_valid_sampling_params_sample_a_token(**params: float) -> None:
    logits = torch.randn(2, 64) * 10
    batch = [row("a", seed=1, prompt=[3, 4], output=[5, 5], **params), row("b", seed=2)]
    assert all(0 <= t < 64 for t in sample(logits, batch))
