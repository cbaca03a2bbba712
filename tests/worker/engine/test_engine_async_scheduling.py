"""``async_scheduling``: each step is launched before the previous step's tokens are read, its
decodes taking their input tokens on the device. Every request must get exactly what the plain
engine gives it (tokens, text, finish reason, logprobs) with or without preemption, whatever
ends it; a penalised request makes the steps it samples in read first; and in a stretch of
decodes the next step really is launched before the last one's tokens are read."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.worker.engine.test_engine import chat_ids, smollm2  # noqa: F401 - fixture
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from tidegate.worker.engine.grammar_masks import TokenMask
from tidegate.worker.engine.model_runner import ModelRunner, StepLogits
from tidegate.worker.engine.sampler import SamplerLaunch
from tidegate.worker.engine.scheduler import SchedulerOutput
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

TEXTS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Name three prime numbers.", "Explain recursion briefly.", "Say hello in German.",
         "Reply with one word: yes or no?", "Name a colour.", "Count to five."]


def requests(loaded: LoadedModel, stop: str | None, stop_id: int | None
             ) -> dict[int, list[EngineRequest]]:
    """The requests, by the step() call they arrive at."""
    ids = [chat_ids(loaded, t) for t in TEXTS]
    return {
        0: [EngineRequest("greedy", ids[0], SamplingParams(max_tokens=6)),
            EngineRequest("seeded", ids[1], SamplingParams(max_tokens=40, temperature=0.9,
                                                           top_p=0.9, seed=7)),
            EngineRequest("stop-string", ids[2], SamplingParams(
                max_tokens=40, stop=[stop] if stop else [])),
            EngineRequest("logprobs", ids[3], SamplingParams(max_tokens=24, logprobs=3)),
            EngineRequest("aborted", ids[4], SamplingParams(max_tokens=40))],
        3: [EngineRequest("eos", ids[5], SamplingParams(max_tokens=30)),
            EngineRequest("stop-token", ids[4], SamplingParams(
                max_tokens=30, stop_token_ids=[stop_id] if stop_id is not None else []))],
        # Its steps read their tokens before scheduling (its sampler needs its own tokens).
        6: [EngineRequest("penalised", ids[6], SamplingParams(
            max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5, temperature=0.8,
            seed=3))],
        9: [EngineRequest("one-token", ids[7], SamplingParams(max_tokens=1)),
            EngineRequest("late-seeded", ids[7], SamplingParams(
                max_tokens=14, temperature=1.0, top_k=20, seed=11, logprobs=2))],
    }


def run(loaded: LoadedModel, scheduling: bool, stop: str | None, stop_id: int | None,
        **config: object) -> tuple[dict[str, list[RequestOutput]], Engine]:
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=2048, max_num_batched_tokens=64, async_output=scheduling,
        async_scheduling=scheduling, **config))  # type: ignore[arg-type]
    assert engine.async_scheduling is scheduling
    join = requests(loaded, stop, stop_id)
    outs: dict[str, list[RequestOutput]] = {}
    for call in itertools.count():
        for req in join.pop(call, []):
            engine.add_request(req)
        if not engine.has_unfinished() and not join:
            return outs, engine
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            if o.request_id == "aborted" and o.num_output_tokens == 5:
                engine.abort("aborted")  # after its 5th token, whenever that arrives
    raise AssertionError("unreachable")


def summary(outs: dict[str, list[RequestOutput]]) -> dict[str, tuple]:
    return {rid: ([o.token_id for o in os_ if o.token_id is not None],
                  "".join(o.text for o in os_), os_[-1].finish_reason, os_[-1].output_text,
                  [o.logprobs for o in os_], [(o.index, o.num_output_tokens) for o in os_])
            for rid, os_ in outs.items()}


@pytest.mark.parametrize("num_blocks", [256, 9])  # 9 blocks: requests preempt each other
def test_async_scheduling_gives_every_request_the_plain_engines_output(
        smollm2: LoadedModel, num_blocks: int) -> None:  # noqa: F811
    first, _ = run(smollm2, False, None, None, num_blocks=num_blocks)
    # A stop string from the middle of a plain run's text, and a stop token from the middle
    # of another's tokens: both found after the next step was launched.
    text = "".join(o.text for o in first["stop-string"])
    stop = text[len(text) // 3: len(text) // 3 + 4]
    assert stop.strip()
    stop_id = [o.token_id for o in first["stop-token"]][6]
    plain_outs, plain = run(smollm2, False, stop, stop_id, num_blocks=num_blocks)
    ahead_outs, ahead = run(smollm2, True, stop, stop_id, num_blocks=num_blocks)
    expected = summary(plain_outs)
    assert summary(ahead_outs) == expected
    assert expected["stop-string"][2] == "stop" and stop not in expected["stop-string"][3]
    assert expected["stop-token"][2] == "stop" and expected["stop-token"][0][-1] == stop_id
    assert expected["eos"][2] == "stop" and expected["eos"][0][-1] in smollm2.tokenizer.eos_token_ids
    assert expected["aborted"][2] == "cancelled" and len(expected["aborted"][0]) == 5
    assert expected["greedy"][2] == expected["one-token"][2] == "length"
    assert len(expected["one-token"][0]) == 1
    assert all(lp is not None for lp in expected["logprobs"][4])
    # Steps ran ahead, except those a penalised request sampled in.
    assert 0 < ahead.stats.scheduled_ahead < ahead.stats.steps - 1
    assert plain.stats.scheduled_ahead == 0
    if num_blocks == 9:
        assert ahead.stats.preemptions > 0
    else:  # the extra tokens of requests that ended unforeseen are dropped, not counted
        assert ahead.stats.decode_tokens == plain.stats.decode_tokens
    assert not ahead.scheduler.has_work() and ahead.blocks.num_free_blocks == num_blocks


def order_of_steps(engine: Engine) -> list[tuple[str, int]]:
    """Wraps the engine's runner to log ("launch", n) when its n-th step's forward pass is
    queued and ("read", n) when that step's tokens are read back."""
    events: list[tuple[str, int]] = []
    steps = itertools.count()
    forward, sample = engine.runner.forward, engine.runner.sample
    numbers: dict[int, int] = {}  # id of a step's logits -> its step number

    def logged_forward(sched: SchedulerOutput, tables: list[list[int]],
                       previous: SamplerLaunch | None = None) -> StepLogits:
        n = next(steps)
        events.append(("launch", n))
        step = forward(sched, tables, previous)
        numbers[id(step)] = n
        return step

    def logged_sample(step: StepLogits, mask: TokenMask | None = None) -> SamplerLaunch:
        n = numbers.pop(id(step))
        launched = sample(step, mask)

        def read() -> object:
            events.append(("read", n))
            return launched.read()

        return dataclasses.replace(launched, read=read)  # type: ignore[arg-type]

    engine.runner.forward = logged_forward  # type: ignore[method-assign]
    engine.runner.sample = logged_sample  # type: ignore[method-assign]
    return events


def decode_order(loaded: LoadedModel, params: SamplingParams
                 ) -> tuple[list[tuple[str, int]], Engine, list[int]]:
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=2048, num_blocks=64, async_output=True, async_scheduling=True))
    events = order_of_steps(engine)
    engine.add_request(EngineRequest("r", chat_ids(loaded, TEXTS[0]), params))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [o.token_id for o in engine.step() if o.token_id is not None]
    return events, engine, tokens


def test_each_decode_step_is_launched_before_the_last_steps_tokens_are_read(
        smollm2: LoadedModel) -> None:  # noqa: F811
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    events, engine, tokens = decode_order(smollm2, params)
    launches = [n for kind, n in events if kind == "launch"]
    # The 16th token is its last: no step is launched for it (nothing beyond the limit).
    assert launches == list(range(16)) and len(tokens) == 16
    for n in launches[:-1]:
        assert events.index(("launch", n + 1)) < events.index(("read", n)), events
    assert engine.stats.scheduled_ahead == 15
    assert engine.stats.decode_tokens == 15
    plain = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(
        max_model_len=2048, num_blocks=64))
    plain.add_request(EngineRequest("r", chat_ids(smollm2, TEXTS[0]), params))
    expected: list[int] = []
    while plain.has_unfinished():
        expected += [o.token_id for o in plain.step() if o.token_id is not None]
    assert tokens == expected


def test_a_penalised_request_reads_each_token_before_the_next_step_is_scheduled(
        smollm2: LoadedModel) -> None:  # noqa: F811
    events, engine, tokens = decode_order(smollm2, SamplingParams(
        max_tokens=8, ignore_eos=True, repetition_penalty=1.2))
    assert len(tokens) == 8
    for n in range(7):
        assert events.index(("read", n)) < events.index(("launch", n + 1)), events
    assert engine.stats.scheduled_ahead == 0


def test_a_pending_input_without_the_step_that_samples_it_is_refused(
        smollm2: LoadedModel) -> None:  # noqa: F811
    engine = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(
        max_model_len=2048, num_blocks=64, async_output=True, async_scheduling=True))
    engine.add_request(EngineRequest("r", chat_ids(smollm2, TEXTS[0]),
                                     SamplingParams(max_tokens=4)))
    engine.step()  # the prefill is in flight: its token is pending
    assert engine._inflight is not None
    engine.scheduler.commit(engine._inflight[0])
    sched = engine.scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in sched.chunks] == [(sched.chunks[0].seq.num_known, 1)]
    tables = [engine.blocks.block_table(c.seq.request_id) for c in sched.chunks]
    runner: ModelRunner = engine.runner
    with pytest.raises(RuntimeError, match="unknown"):
        runner.launch(sched, tables)


def test_async_scheduling_needs_async_output() -> None:
    with pytest.raises(ValueError, match="async_output"):
        EngineConfig(max_model_len=64, async_output=False, async_scheduling=True)


def test_decoding_requests_hold_no_prompt_work_while_steps_run_ahead() -> None:
    """``pending_prefill_tokens`` (what the intake, the shedder and the speculation governor
    read) counts prompts only: a request decoding ahead of its unread token holds none."""
    tiny = load_model("random:tiny", device="cpu", dtype=torch.float32, seed=0)
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(
        max_model_len=256, max_num_batched_tokens=64, async_output=True,
        async_scheduling=True))
    for i in range(4):
        engine.add_request(EngineRequest(f"r{i}", [5 + i] * 40, SamplingParams(
            max_tokens=30, ignore_eos=True)))
    assert engine.pending_prefill_tokens == 160
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.pending_prefill_tokens)
    # Steps of 64 tokens take the 160 prompt tokens in (each counted once its step is read);
    # from then on the four requests only decode, a token pending each, and hold none.
    first_zero = seen.index(0)
    assert seen[:first_zero] == sorted(seen[:first_zero], reverse=True), seen
    assert first_zero <= 4 and set(seen[first_zero:]) == {0} and len(seen) > 20, seen
    assert engine.stats.scheduled_ahead > 0  # the steps did run ahead
