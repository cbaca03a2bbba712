"""``async_output``: a step's outputs are built while the next step runs. Every request must get
exactly what the plain engine gives it (tokens, text, finish reason, logprobs), one call later:
stop strings found a step late drop the extra token, aborts drop the in-flight one, preemption
and seeded sampling are unaffected. (Here each step's tokens are read before the next is
scheduled; test_engine_async_scheduling.py launches the next step first.)"""

from __future__ import annotations

import pytest

from tests.worker.engine.test_engine import chat_ids, smollm2  # noqa: F401 - fixture
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from tidegate.worker.models.loaders.loader import LoadedModel

pytestmark = pytest.mark.slow

TEXTS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Name three prime numbers.", "Explain recursion briefly.", "Say hello in German."]


def requests(loaded: LoadedModel, stop: str | None) -> list[EngineRequest]:
    ids = [chat_ids(loaded, t) for t in TEXTS]
    return [
        EngineRequest("greedy", ids[0], SamplingParams(max_tokens=24)),
        EngineRequest("seeded", ids[1], SamplingParams(max_tokens=20, temperature=0.9,
                                                       top_p=0.9, seed=7)),
        EngineRequest("stop-string", ids[2], SamplingParams(
            max_tokens=40, stop=[stop] if stop else [])),
        EngineRequest("logprobs", ids[3], SamplingParams(max_tokens=12, logprobs=3)),
        EngineRequest("aborted", ids[4], SamplingParams(max_tokens=40)),
    ]


def run(loaded: LoadedModel, async_output: bool, stop: str | None, **config: object
        ) -> dict[str, list[RequestOutput]]:
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=2048, max_num_batched_tokens=64, async_output=async_output,
        async_scheduling=False, **config))  # type: ignore[arg-type]
    assert engine.async_output is async_output
    for req in requests(loaded, stop):
        engine.add_request(req)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            if o.request_id == "aborted" and o.num_output_tokens == 5:
                engine.abort("aborted")  # after its 5th token, whenever that arrives
    return outs


def summary(outs: dict[str, list[RequestOutput]]) -> dict[str, tuple]:
    return {rid: ([o.token_id for o in os_ if o.token_id is not None],
                  "".join(o.text for o in os_), os_[-1].finish_reason, os_[-1].output_text,
                  [o.logprobs for o in os_])
            for rid, os_ in outs.items()}


@pytest.mark.parametrize("num_blocks", [256, 9])  # 9 blocks: requests preempt each other
def test_async_output_gives_every_request_the_plain_engines_output(
        smollm2: LoadedModel, num_blocks: int) -> None:  # noqa: F811
    first = summary(run(smollm2, False, None, num_blocks=num_blocks))
    # A stop string from the middle of the plain run's text: found one step late when async.
    text = first["stop-string"][1]
    stop = text[len(text) // 3: len(text) // 3 + 4]
    assert stop.strip()
    plain = summary(run(smollm2, False, stop, num_blocks=num_blocks))
    overlapped = summary(run(smollm2, True, stop, num_blocks=num_blocks))
    assert overlapped == plain
    assert plain["stop-string"][2] == "stop" and stop not in plain["stop-string"][3]
    assert plain["aborted"][2] == "cancelled" and len(plain["aborted"][0]) == 5
    assert all(lp is not None for lp in plain["logprobs"][4])
