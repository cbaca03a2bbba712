"""The worker against a real redis-server: jobs in, events and results out, bad jobs survived."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.events.follow import follow
from tidegate.jobstore import JOB_FIELD, enqueue, read_result
from tidegate.protocol import JobRequest, SamplingParams
from tidegate.worker.engine.engine import Engine, EngineConfig, EngineRequest
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.service.service import WorkerService


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny")


@pytest.fixture
async def worker(aredis: aioredis.Redis, tiny: LoadedModel) -> AsyncIterator[WorkerService]:
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, max_num_seqs=4))
    service = WorkerService(aredis, engine, model="random_tiny", worker_id="w-test")
    task = asyncio.create_task(service.run())
    yield service
    service.stop()
    await asyncio.wait_for(task, 10)


async def collect(aredis: aioredis.Redis, job_id: str) -> list[dict]:
    async def run() -> list[dict]:
        return [e.data() async for e in follow(aredis, job_id)]

    return await asyncio.wait_for(run(), 60)


async def submit(aredis: aioredis.Redis, **body: object) -> str:
    job = JobRequest.model_validate(body).to_job(model="random_tiny", default_timeout_s=60)
    await enqueue(aredis, job)
    return job.id


async def pending(aredis: aioredis.Redis, lane: str = "interactive") -> int:
    info = await aredis.xpending(keys.lane_stream("random_tiny", lane), keys.CONSUMER_GROUP)
    return info["pending"]


async def test_jobs_stream_tokens_store_results_and_are_acked(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    ids = [await submit(aredis, prompt=f"hello {i}", max_tokens=5 + i, temperature=0.8, seed=i)
           for i in range(6)]
    for i, job_id in enumerate(ids):
        events = await collect(aredis, job_id)
        assert [e["type"] for e in events][:2] == ["queued", "started"]
        assert [e["id"] for e in events] == list(range(1, len(events) + 1))
        tokens = [e for e in events if e["type"] == "token"]
        done = events[-1]
        generated = [t for e in tokens for t in e["token_ids"]]
        assert done["type"] == "done" and len(generated) == done["usage"]["completion_tokens"]
        assert "".join(t["text"] for t in tokens) == done["text"]
        # An event carries the tokens generated since the worker's last write, in order.
        starts = [0] + [len(e["token_ids"]) for e in tokens[:-1]]
        assert [t["index"] for t in tokens] == [sum(starts[: k + 1]) for k in range(len(tokens))]
        result = await read_result(aredis, job_id)
        assert result is not None and result.status == "done" and result.text == done["text"]
        assert result.usage.completion_tokens <= 5 + i
    assert await pending(aredis) == 0


async def test_malformed_jobs_are_rejected_acked_and_survived(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    stream = keys.lane_stream("random_tiny", "interactive")
    await aredis.xadd(stream, {"nonsense": "1"})
    await aredis.xadd(stream, {JOB_FIELD: "{not json"})
    await aredis.xadd(stream, {JOB_FIELD: json.dumps({"id": "badjob", "prompt": "x",
                                                       "deadline_ms": 1, "created_ms": 1,
                                                       "surprise": True})})
    events = await collect(aredis, "badjob")
    assert events[-1]["type"] == "error" and events[-1]["code"] == "invalid_job"
    assert "surprise" in events[-1]["message"]
    # The worker is still serving.
    good = await submit(aredis, prompt="still alive?", max_tokens=3)
    assert (await collect(aredis, good))[-1]["type"] == "done"
    assert await pending(aredis) == 0


async def test_prompt_over_the_context_is_an_error_not_a_crash(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    job_id = await submit(aredis, prompt="x" * 400, max_tokens=10)
    events = await collect(aredis, job_id)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "invalid_request"
    assert "context" in events[-1]["message"]
    result = await read_result(aredis, job_id)
    assert result is not None and result.status == "error"


async def test_batch_lane_is_served_and_heartbeat_is_visible(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    job_id = await submit(aredis, prompt="offline work", max_tokens=4, lane="batch")
    assert (await collect(aredis, job_id))[-1]["type"] == "done"
    assert await aredis.exists(keys.worker_heartbeat("w-test"))
    assert await pending(aredis, "batch") == 0


async def test_logprobs_reach_token_events_only_when_asked(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    with_lp = await submit(aredis, prompt="abc", max_tokens=3, logprobs=3)
    without = await submit(aredis, prompt="abc", max_tokens=3)
    tokens = [e for e in await collect(aredis, with_lp) if e["type"] == "token"]
    assert tokens and all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in tokens)
    assert [t["index"] for t in tokens] == [0, 1, 2]  # one token per event: each its logprobs
    assert all(t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"] for t in tokens)
    plain = [e for e in await collect(aredis, without) if e["type"] == "token"]
    assert plain and all("logprob" not in t and "top_logprobs" not in t for t in plain)


async def test_a_job_naming_an_unregistered_adapter_is_rejected_adapter_not_found(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    job = JobRequest(prompt="hi", max_tokens=3).to_job(model="random_tiny", adapter="ghost",
                                                       default_timeout_s=60)
    await enqueue(aredis, job)
    events = await collect(aredis, job.id)
    assert (events[-1]["type"], events[-1]["reason"]) == ("rejected", "adapter_not_found")
    assert "'ghost'" in events[-1]["message"]
    assert await pending(aredis) == 0


async def test_a_job_the_api_rejected_while_it_waited_is_acked_unrun(
    aredis: aioredis.Redis, tiny: LoadedModel
) -> None:
    from tidegate.jobstore import reject_queued

    job_id = await submit(aredis, prompt="too late", max_tokens=3)
    assert await reject_queued(aredis, job_id, reason="no_worker", message="nobody") == "ok"
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, max_num_seqs=4))
    service = WorkerService(aredis, engine, model="random_tiny", worker_id="w-late")
    task = asyncio.create_task(service.run())
    try:
        deadline = asyncio.get_running_loop().time() + 20
        stream = keys.lane_stream("random_tiny", "interactive")
        while (await aredis.xinfo_groups(stream) or [{"lag": 1}])[0]["lag"] or \
                await pending(aredis):  # read and acked
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.1)
    finally:
        service.stop()
        await asyncio.wait_for(task, 10)
    events = await collect(aredis, job_id)
    assert [e["type"] for e in events] == ["queued", "rejected"]  # nothing after: never ran


async def test_jobs_waiting_only_for_the_steps_budget_do_not_stop_the_intake(
    aredis: aioredis.Redis, tiny: LoadedModel
) -> None:
    """A request the engine left for the next step's token budget starts a step later: the
    worker still reads the lane, so a wave's later jobs wait in the engine, not in Redis as
    well. Holding more prompt work than it computes in half a second, it reads nothing."""
    engine = Engine(tiny.model, tiny.tokenizer,
                    EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64))
    service = WorkerService(aredis, engine, model="random_tiny", worker_id="w-budget")
    await service.intake.ensure_groups()
    vocab = tiny.tokenizer.vocab_size
    for r in range(2):  # 64 prompt tokens each: the first fills the step's budget
        engine.add_request(EngineRequest(f"r{r}", [(97 * r + 5 * i) % (vocab - 1) + 1
                                                   for i in range(64)],
                                         SamplingParams(max_tokens=4)))
    engine.step()
    assert (engine.num_waiting, engine.num_backlogged) == (1, 0)
    job_id = await submit(aredis, prompt="hello", max_tokens=4)
    await service.arrivals._once()
    assert [a.job.id for a in service.arrivals.take()] == [job_id]

    service.shedder.observe_step(100, 0, 1.0)  # prompts measured at 100 tokens/s: 0.64 s held
    await submit(aredis, prompt="world", max_tokens=4)
    await service.arrivals._once()
    assert service.arrivals.take() == [] and await pending(aredis) == 1  # the first job only
