"""Tensor- and pipeline-parallel engines (gloo, CPU processes) against the single-process
engine: the same greedy tokens in float32, and the same seeded samples, through chunked
prefill, prefix caching, preemption, penalties and logprobs."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from tests.worker.engine.test_engine_structured import conforms, mixed_requests
from tests.worker.engine_runs import run_to_end
from tidegate.protocol import SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from tidegate.worker.models.loaders.loader import load_model
from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.parallel_engine import start_parallel_engine

pytestmark = pytest.mark.slow

LAYOUTS = [(2, 1), (1, 2), (2, 2)]
# Small enough that the workload below preempts and chunks its prompts.
CONFIG = EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=48,
                      num_blocks=36, block_size=16)


def workload() -> list[EngineRequest]:
    system = [(7 * i) % 500 + 3 for i in range(40)]  # a shared prefix: cached after the first
    reqs = []
    for i in range(10):
        tail = [(13 * i + 5 * j) % 500 + 3 for j in range(10 + 17 * (i % 4))]
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        if i % 3 == 1:
            params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=100 + i,
                                    ignore_eos=True)
        elif i % 3 == 2 and i > 2:
            params = SamplingParams(max_tokens=40, temperature=0.7, top_k=20, seed=i,
                                    repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3,
                                    ignore_eos=True)
        reqs.append(EngineRequest(f"req-{i}", system + tail, params))
    return reqs


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    return run_to_end(engine, reqs, max_steps=10_000)


def tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [o.token_id for o in os if o.token_id is not None] for rid, os in outs.items()}


def finishes(outs: dict[str, list[RequestOutput]]) -> dict[str, str | None]:
    return {rid: os[-1].finish_reason for rid, os in outs.items()}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, list[RequestOutput]], Engine]:
    loaded = load_model("random:tiny")
    engine = Engine(loaded.model, loaded.tokenizer, CONFIG)
    return run(engine, workload()), engine


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def parallel(request: pytest.FixtureRequest) -> Iterator[Engine]:
    tp, pp = request.param
    engine = start_parallel_engine("random:tiny", ParallelLayout(tp, pp), CONFIG,
                                   torch_threads=1)
    yield engine
    engine.close()
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith("tidegate-rank")], "a rank outlived Engine.close"


def test_same_tokens_as_one_process(reference: tuple[dict[str, list[RequestOutput]], Engine],
                                    parallel: Engine) -> None:
    ref, ref_engine = reference
    outs = run(parallel, workload())
    assert tokens(outs) == tokens(ref)
    assert finishes(outs) == finishes(ref)
    # The workload reaches what it is meant to: chunks, cache hits, preemptions.
    for engine in (ref_engine, parallel):
        assert engine.stats.preemptions > 0
        assert engine.scheduler.prefix_hit_tokens > 0
    # Pipeline stages work on two steps at once (different requests), most of the time.
    stats = parallel.stats
    if parallel.pipeline_depth:
        assert stats.overlapped_steps > stats.steps / 2, stats
    else:
        assert stats.overlapped_steps == 0
    # Logprobs: the gathered logits of the vocabulary shards, to float32 rounding.
    for rid, os in outs.items():
        for got, want in zip(os, ref[rid], strict=True):
            assert (got.logprobs is None) == (want.logprobs is None)
            if got.logprobs is not None and want.logprobs is not None:
                assert [t for t, _ in got.logprobs.top] == [t for t, _ in want.logprobs.top]
                assert got.logprobs.logprob == pytest.approx(want.logprobs.logprob, abs=1e-4)


def test_an_engine_steps_on_after_an_abort(parallel: Engine) -> None:
    """Aborted and finished requests leave every rank: the engine serves the next batch."""
    reqs = workload()[:4]
    for r in reqs:
        parallel.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    for o in parallel.step():
        outs.setdefault(o.request_id, []).append(o)
    parallel.abort("req-1")
    while parallel.has_unfinished():
        for o in parallel.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["req-1"][-1].finish_reason == "cancelled"
    again = run(parallel, [EngineRequest("again", reqs[0].prompt_ids, reqs[0].params)])
    assert tokens(again)["again"] == tokens(outs)["req-0"]


def test_one_parallel_engine_per_process(parallel: Engine) -> None:
    """The process group is the process's: a second parallel engine is refused up front
    (the CLI refuses two parallel models in one worker)."""
    with pytest.raises(ValueError, match="one per process"):
        start_parallel_engine("random:tiny", ParallelLayout(2, 1), CONFIG)
    assert run(parallel, workload()[:1])  # the running one is unharmed


def test_structured_outputs_the_same_on_every_layout(parallel: Engine) -> None:
    """Grammar masks travel with each step's sampling to every rank that samples: every
    format's greedy and seeded outputs are the single process's."""
    loaded = load_model("random:tiny")
    reqs = mixed_requests(loaded)
    want = run(Engine(loaded.model, loaded.tokenizer, CONFIG), reqs)
    got = run(parallel, reqs)
    assert tokens(got) == tokens(want)
    for rid, outs in got.items():
        kind = rid.split("-")[0]
        if kind != "free" and outs[-1].finish_reason == "stop":
            conforms(kind, outs[-1].output_text)
