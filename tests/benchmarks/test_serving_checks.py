"""The serving benchmark's own checks, without a stack: what counts as exact, what a prompt is."""

from __future__ import annotations

import json
import random

import pytest

from tidegate.benchmarks.harness.load.follow import Trace
from tidegate.benchmarks.harness.load.loadgen import JobRecord
from tidegate.benchmarks.harness.load.workload import (
    CHAT_PROMPT_MEAN,
    CHAT_RESPONSE_MEAN,
    CHAT_TURNS_MEAN,
    QUOTE_ASK,
    build_work,
    chat_lengths,
    exact_prompt,
    poisson_offsets,
)
from tidegate.benchmarks.harness.measure.metrics import Slo, exactness_problem
from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import load_tokenizer


def events(texts: list[list[str]], *, prompt_tokens: int = 4) -> list[dict]:
    """queued, started, one token event per inner list (several tokens each), done."""
    out: list[dict] = [{"type": "queued", "id": 1, "job_id": "j", "lane": "interactive"},
                       {"type": "started", "id": 2, "job_id": "j", "worker": "w",
                        "prompt_tokens": prompt_tokens}]
    index = 0
    for chunk in texts:
        out.append({"type": "token", "id": len(out) + 1, "job_id": "j", "index": index,
                    "text": "".join(chunk), "token_ids": list(range(index, index + len(chunk)))})
        index += len(chunk)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": index,
             "total_tokens": prompt_tokens + index}
    text = "".join("".join(c) for c in texts)
    out.append({"type": "done", "id": len(out) + 1, "job_id": "j", "finish_reason": "length",
                "text": text, "usage": usage, "timings": {}})
    return out


def followed(evs: list[dict], *, output_len: int, input_len: int = 4) -> JobRecord:
    trace = Trace()
    for t, e in enumerate(evs):
        trace.on_event(json.dumps(e), float(t))
    done = evs[-1]
    result = {"status": "done", "text": done.get("text"), "finish_reason": "length",
              "usage": done.get("usage")}
    return JobRecord(0, "ws", input_len, output_len, 0.0, job_id="j", trace=trace,
                     result=result)


SLO = Slo(deadline_s=600)


def test_multi_token_events_count_their_tokens_not_the_events() -> None:
    rec = followed(events([["a"], ["b", "c", "d"], ["e", "f"]]), output_len=6)
    assert rec.trace is not None
    assert (rec.trace.tokens, rec.trace.token_counts, rec.trace.text) == (6, [1, 3, 2], "abcdef")
    assert exactness_problem(rec, SLO) is None


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda evs: evs.pop(3), "event id"),  # a gap
    (lambda evs: evs.insert(3, evs[2]), "event id"),  # a duplicate
    (lambda evs: evs.append({**evs[-1], "id": evs[-1]["id"] + 1}), "after the final"),
    (lambda evs: evs[3].update(index=5), "token index"),
    (lambda evs: evs[3].update(text="X"), "stored text"),
])
def test_a_broken_stream_is_not_exact(mutate, reason: str) -> None:  # noqa: ANN001
    evs = events([["a"], ["b"], ["c"], ["d"]])
    good_done = dict(evs[-1])
    mutate(evs)
    rec = followed(evs, output_len=4)
    rec.result = {"status": "done", "text": good_done["text"], "finish_reason": "length",
                  "usage": good_done["usage"]}
    problem = exactness_problem(rec, SLO)
    assert problem is not None and reason in problem


def test_a_short_or_mismeasured_job_is_not_exact() -> None:
    assert "output length" in exactness_problem(
        followed(events([["a"], ["b"]]), output_len=3), SLO)
    assert "prompt_tokens" in exactness_problem(
        followed(events([["a"]], prompt_tokens=5), output_len=1, input_len=4), SLO)


def test_a_shed_job_is_legitimate_only_when_a_deadline_was_asked_for() -> None:
    rec = JobRecord(0, "poll", 4, 8, 0.0, job_id="j",
                    result={"status": "rejected", "error": {"code": "cannot_meet_deadline"}})
    assert exactness_problem(rec, Slo(deadline_s=1, deadline_given=True)) is None
    assert "rejected" in exactness_problem(rec, SLO)


@pytest.mark.parametrize("model", ["random:tiny", "smollm2"])
def test_prompts_have_exactly_the_asked_tokens_and_differ(model: str) -> None:
    tokenizer = load_tokenizer(resolve_model(model))
    rng = random.Random(0)
    for n in (2, 3, 17, 64, 256):
        prompts = [exact_prompt(lambda s: tokenizer.encode_prompt(s, None), n, rng)
                   for _ in range(5)]
        assert all(len(tokenizer.encode_prompt(p.text, None)) == n for p in prompts)
        # Only full 16-token blocks are prefix-cached: shorter prompts may repeat.
        assert n < 16 or len({p.text for p in prompts}) == 5


def test_the_quote_workload_asks_to_repeat_words_of_exact_length() -> None:
    tokenizer = load_tokenizer(resolve_model("smollm2"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode_prompt(text, None)

    work = build_work(encode, [0.0] * 4, input_len=64, output_len=8, input_span=None,
                      output_span=None, seed=3, quote=True)
    for p in work.prompts:
        assert p.text.startswith(QUOTE_ASK) and len(p.text) > len(QUOTE_ASK) + 20
        assert encode(p.text) == list(p.token_ids) and p.tokens == 64
    assert len({p.text for p in work.prompts}) == 4


def test_poisson_arrivals_by_count_or_by_duration() -> None:
    by_count = poisson_offsets(50.0, random.Random(1), count=2000)
    assert len(by_count) == 2000 and by_count[0] == 0.0
    assert 45 < (len(by_count) - 1) / by_count[-1] < 55
    assert max(poisson_offsets(50.0, random.Random(1), duration_s=2.0)) < 2.0


def test_chat_lengths_follow_the_documented_averages_and_their_long_tail() -> None:
    ins, outs = chat_lengths(20_000, random.Random(7))
    # A turn carries (turns - 1) earlier prompts and responses: its mean input is the prompt
    # mean plus the mean number of earlier turns times a turn's tokens.
    expected_in = CHAT_PROMPT_MEAN + (CHAT_TURNS_MEAN - 1) * (CHAT_PROMPT_MEAN
                                                             + CHAT_RESPONSE_MEAN)
    assert sum(ins) / len(ins) == pytest.approx(expected_in, rel=0.05)
    assert sum(outs) / len(outs) == pytest.approx(CHAT_RESPONSE_MEAN, rel=0.05)
    ordered = sorted(ins)
    assert ordered[len(ins) // 2] < 0.7 * expected_in  # long-tailed: the median well below
    assert ordered[int(0.99 * len(ins))] > 4 * expected_in  # the mean, a tail far above it
    clipped, short = chat_lengths(2000, random.Random(7), input_span=(100, 2000),
                                  output_span=(50, 500), scale=2.0)
    assert min(clipped) == 100 and max(clipped) == 2000 and 50 <= min(short) < max(short) <= 500


def test_a_share_of_prompts_begins_with_one_system_prompt() -> None:
    tokenizer = load_tokenizer(resolve_model("random:tiny"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode_prompt(text, None)

    work = build_work(encode, [0.0] * 8, input_len=0, output_len=8, input_span=(40, 120),
                      output_span=(4, 8), seed=5, chat_scale=0.5, shared_share=0.25,
                      shared_len=48)
    shared = [p for p in work.prompts if p.token_ids[:40] == work.prompts[3].token_ids[:40]]
    assert [work.prompts.index(p) for p in shared] == [3, 7]  # every fourth job
    for p in work.prompts:
        assert encode(p.text) == list(p.token_ids) and 40 <= p.tokens
    assert all(p.tokens > 48 for p in shared)  # the system prompt and words of its own
    assert len({p.text for p in work.prompts}) == 8
