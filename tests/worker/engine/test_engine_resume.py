"""Continuing a request from tokens another run generated (a migrated job): whatever the cut,
the tokens, texts, indices and end are the uninterrupted run's, greedy or seeded, with
penalties and stop strings; a continuation that cannot hold is refused with ``ResumeError``."""

from __future__ import annotations

import pytest

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    RequestOutput,
    ResumeError,
)
from tidegate.worker.models.loaders.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


def run(loaded: LoadedModel, request: EngineRequest) -> list[RequestOutput]:
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_model_len=2048, num_blocks=256))
    engine.add_request(request)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def continued(loaded: LoadedModel, request: EngineRequest, outs: list[RequestOutput], cut: int
              ) -> EngineRequest:
    """The request as a new worker gets it: the first ``cut`` tokens and the text they sent."""
    kept = outs[:cut]
    return EngineRequest(request.request_id, request.prompt_ids, request.params,
                         output_ids=tuple(o.token_id for o in kept),
                         output_text="".join(o.text for o in kept), seed=request.seed)


def view(outs: list[RequestOutput]) -> list[tuple[int | None, int, str, str | None, int]]:
    return [(o.token_id, o.index, o.text, o.finish_reason, o.num_output_tokens) for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, repetition_penalty=1.2,
                   frequency_penalty=0.3),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=20, min_p=0.02, seed=123),
], ids=["greedy", "seeded-penalised", "seeded-top-k-min-p"])
def test_continued_run_equals_the_uninterrupted_one(smollm2: LoadedModel,
                                                    params: SamplingParams) -> None:
    ids = smollm2.tokenizer.encode_prompt(None, [{"role": "user", "content": PROMPT}])
    request = EngineRequest("job", ids, params)
    whole = run(smollm2, request)
    assert len(whole) == 24 and whole[-1].finish_reason == "length"
    for cut in (1, 13, 23):
        rest = run(smollm2, continued(smollm2, request, whole, cut))
        assert view(rest) == view(whole[cut:]), f"cut at {cut}"
        assert rest[-1].output_text == whole[-1].output_text


def test_an_unseeded_request_continues_on_the_seed_its_worker_gave_it(
        smollm2: LoadedModel) -> None:
    ids = smollm2.tokenizer.encode_prompt(None, [{"role": "user", "content": PROMPT}])
    request = EngineRequest("job", ids, SamplingParams(max_tokens=32, temperature=0.8),
                            seed=2**40 + 5)
    whole = run(smollm2, request)
    rest = run(smollm2, continued(smollm2, request, whole, 12))
    assert view(rest) == view(whole[12:])


def test_a_stop_string_spanning_the_cut_still_stops_the_run(smollm2: LoadedModel) -> None:
    ids = smollm2.tokenizer.encode_prompt(None, [{"role": "user", "content": PROMPT}])
    free = run(smollm2, EngineRequest("job", ids, SamplingParams(max_tokens=60)))
    text = free[-1].output_text
    # A stop string made of the text of tokens 20..22: the cut at 21 falls inside it.
    stop = "".join(o.text for o in free[20:23]).strip()
    assert len(stop) >= 3 and text.find(stop) > 0
    request = EngineRequest("job", ids, SamplingParams(max_tokens=60, stop=[stop]))
    whole = run(smollm2, request)
    assert whole[-1].finish_reason == "stop"
    cut = len(whole) - 2
    rest = run(smollm2, continued(smollm2, request, whole, cut))
    assert view(rest) == view(whole[cut:])
    assert rest[-1].output_text == whole[-1].output_text == text[:text.find(stop)]


def test_a_continuation_that_cannot_hold_is_refused(smollm2: LoadedModel) -> None:
    ids = smollm2.tokenizer.encode_prompt(None, [{"role": "user", "content": PROMPT}])
    request = EngineRequest("job", ids, SamplingParams(max_tokens=16))
    whole = run(smollm2, request)
    engine = Engine(smollm2.model, smollm2.tokenizer,
                    EngineConfig(max_model_len=2048, num_blocks=256))
    good = continued(smollm2, request, whole, 8)
    wrong_text = EngineRequest("job", ids, request.params, output_ids=good.output_ids,
                               output_text=good.output_text + "x")
    with pytest.raises(ResumeError, match="text already sent"):
        engine.check_request(wrong_text)
    with pytest.raises(ResumeError, match="max_tokens"):
        engine.check_request(continued(smollm2, request, whole, 16))
    eos = min(smollm2.tokenizer.eos_token_ids)
    with pytest.raises(ResumeError, match="stop token"):
        engine.check_request(EngineRequest("job", ids, request.params, output_ids=(eos,)))
    engine.check_request(good)  # the right one is fine
