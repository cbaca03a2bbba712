"""The engine on the real default model: fidelity, continuous batching, stops, aborts, seeds."""

from __future__ import annotations

import pytest

from tidegate.protocol import SamplingParams
from worker.engine import Engine, EngineConfig, EngineRequest, RequestError, RequestOutput
from worker.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "What is 12 plus 30?",
]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


def make_engine(loaded: LoadedModel, **config: int) -> Engine:
    return Engine(loaded.model, loaded.tokenizer, EngineConfig(max_model_len=2048, **config))


def chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode_prompt(None, [{"role": "user", "content": text}])


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def test_greedy_output_equals_hf_transformers(smollm2: LoadedModel) -> None:
    from tests.worker.hf_oracle import hf_greedy

    engine = make_engine(smollm2)
    prompts = {f"c{i}": chat_ids(smollm2, text) for i, text in enumerate(CHATS)}
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=40)))
    outs = run_all(engine)
    for rid, ids in prompts.items():
        assert tokens(outs[rid]) == hf_greedy(ids, 40), rid
    assert "Paris" in outs["c0"][-1].output_text


def test_joining_mid_batch_changes_nothing(smollm2: LoadedModel) -> None:
    params = SamplingParams(max_tokens=24)
    target = chat_ids(smollm2, "Name three colours of the rainbow.")
    alone = make_engine(smollm2)
    alone.add_request(EngineRequest("t", target, params))
    expected = tokens(run_all(alone)["t"])

    busy = make_engine(smollm2)
    for i, text in enumerate(CHATS):
        busy.add_request(EngineRequest(f"o{i}", chat_ids(smollm2, text), params))
    got: list[int] = []
    for step in range(200):
        if step == 5:  # joins while the others are decoding
            busy.add_request(EngineRequest("t", target, params))
        for o in busy.step():
            if o.request_id == "t" and o.token_id is not None:
                got.append(o.token_id)
        if not busy.has_unfinished():
            break
    assert got == expected


def test_streamed_text_equals_final_text_and_stops_apply(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2)
    ids = chat_ids(smollm2, "Count from 1 to 20, separated by commas.")
    engine.add_request(EngineRequest("len", ids, SamplingParams(max_tokens=7)))
    engine.add_request(EngineRequest("stop", ids, SamplingParams(max_tokens=60, stop=["5"])))
    outs = run_all(engine)
    assert outs["len"][-1].finish_reason == "length" and len(tokens(outs["len"])) == 7
    assert outs["stop"][-1].finish_reason == "stop"
    for rid in ("len", "stop"):
        assert "".join(o.text for o in outs[rid]) == outs[rid][-1].output_text
    assert "5" not in outs["stop"][-1].output_text and "4" in outs["stop"][-1].output_text


def test_abort_finishes_a_running_request_as_cancelled(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2)
    engine.add_request(EngineRequest("a", chat_ids(smollm2, CHATS[0]), SamplingParams(max_tokens=100)))
    engine.step()
    engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "cancelled")]
    assert not engine.has_unfinished() and len(engine.runner.cache) == 0


def test_seeded_sampling_is_reproducible_across_batches(smollm2: LoadedModel) -> None:
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    ids = chat_ids(smollm2, "Tell me a short story about a fox.")
    alone = make_engine(smollm2)
    alone.add_request(EngineRequest("s", ids, sampled))
    expected = tokens(run_all(alone)["s"])

    crowd = make_engine(smollm2)
    for i, text in enumerate(CHATS):
        crowd.add_request(EngineRequest(f"o{i}", chat_ids(smollm2, text),
                                        SamplingParams(max_tokens=20, temperature=1.0)))
    crowd.add_request(EngineRequest("s", ids, sampled))
    assert tokens(run_all(crowd)["s"]) == expected
    other_seed = make_engine(smollm2)
    other_seed.add_request(EngineRequest("s", ids, sampled.model_copy(update={"seed": 99})))
    assert tokens(run_all(other_seed)["s"]) != expected


def test_requests_that_can_never_run_are_refused(smollm2: LoadedModel) -> None:
    engine = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(max_model_len=16))
    with pytest.raises(RequestError, match="context"):
        engine.add_request(EngineRequest("x", list(range(1, 40)), SamplingParams()))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(EngineRequest("y", [], SamplingParams()))


def test_max_num_seqs_caps_the_running_batch(smollm2: LoadedModel) -> None:
    engine = make_engine(smollm2, max_num_seqs=2)
    for i in range(5):
        engine.add_request(EngineRequest(f"r{i}", chat_ids(smollm2, CHATS[i % 3]),
                                         SamplingParams(max_tokens=3)))
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 3
    outs = run_all(engine)
    assert sorted(outs) == [f"r{i}" for i in range(5)]
