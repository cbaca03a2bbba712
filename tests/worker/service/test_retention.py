"""Retention by final status, through a real worker and redis-server: each way a job can end
leaves its hash and event stream with that status's TTL, and a short final stream compacted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.events.follow import follow
from tidegate.jobstore import enqueue, request_cancel
from tidegate.protocol import JobRequest
from tidegate.retention import Retention
from tidegate.worker.engine.engine import Engine, EngineConfig
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.service.service import WorkerService

pytestmark = pytest.mark.timeout(60)

# Distinct values, so a TTL tells which setting set it.
RETENTION = Retention(unfinished_s=5000, result_s=4000, error_s=3000, rejected_s=2000,
                      cancelled_s=1000)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny")


def new_worker(aredis: aioredis.Redis, tiny: LoadedModel) -> WorkerService:
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, max_num_seqs=4))
    return WorkerService(aredis, engine, model="random_tiny", worker_id="w-retention", retention=RETENTION)


@pytest.fixture
async def worker(aredis: aioredis.Redis, tiny: LoadedModel) -> AsyncIterator[WorkerService]:
    service = new_worker(aredis, tiny)
    task = asyncio.create_task(service.run())
    yield service
    service.stop()
    await asyncio.wait_for(task, 10)


async def submit(aredis: aioredis.Redis, *, deadline_ms: int | None = None, **body: object) -> str:
    job = JobRequest.model_validate(body).to_job(model="random_tiny", default_timeout_s=60)
    if deadline_ms is not None:
        job = job.model_copy(update={"deadline_ms": deadline_ms})
    await enqueue(aredis, job, ttl_s=RETENTION.unfinished_s)
    return job.id


async def final_event(aredis: aioredis.Redis, job_id: str) -> dict:
    async def run() -> list[dict]:
        return [e.data() async for e in follow(aredis, job_id)]

    return (await asyncio.wait_for(run(), 30))[-1]


async def ttls(aredis: aioredis.Redis, job_id: str) -> tuple[int, int]:
    return (await aredis.ttl(keys.job_hash(job_id)), await aredis.ttl(keys.job_events(job_id)))


def about(expected: int) -> tuple[int, int]:
    return (expected - 5, expected)


async def assert_retained(aredis: aioredis.Redis, job_id: str, expected: int) -> None:
    hash_ttl, events_ttl = await ttls(aredis, job_id)
    low, high = about(expected)
    assert low <= hash_ttl <= high and low <= events_ttl <= high, (hash_ttl, events_ttl)


async def test_each_final_status_keeps_the_jobs_keys_for_its_own_retention(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    done = await submit(aredis, prompt="hello", max_tokens=4)
    error = await submit(aredis, prompt="x" * 400, max_tokens=4)  # over the 256-token context
    rejected = await submit(aredis, prompt="late", max_tokens=4, deadline_ms=1)
    assert (await final_event(aredis, done))["type"] == "done"
    assert (await final_event(aredis, error))["type"] == "error"
    assert (await final_event(aredis, rejected))["type"] == "rejected"
    await assert_retained(aredis, done, RETENTION.result_s)
    await assert_retained(aredis, error, RETENTION.error_s)
    await assert_retained(aredis, rejected, RETENTION.rejected_s)


async def test_a_job_cancelled_while_running_keeps_the_cancelled_retention(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    job_id = await submit(aredis, prompt="long", max_tokens=200, ignore_eos=True)
    async for event in follow(aredis, job_id):
        if event.type == "token":
            # Unfinished: the keys have the unfinished TTL until the final event.
            assert (await ttls(aredis, job_id))[1] > RETENTION.result_s
            assert await request_cancel(aredis, job_id, ttl_s=RETENTION.cancelled_s) == \
                "cancelling"
            break
    final = await final_event(aredis, job_id)
    assert (final["type"], final["finish_reason"]) == ("done", "cancelled")
    await assert_retained(aredis, job_id, RETENTION.cancelled_s)


async def test_cancelled_before_start_and_while_queued_keep_the_cancelled_retention(
    aredis: aioredis.Redis, tiny: LoadedModel
) -> None:
    queued = await submit(aredis, prompt="never runs", max_tokens=4)
    assert await request_cancel(aredis, queued, ttl_s=RETENTION.cancelled_s) == "cancelled"
    await assert_retained(aredis, queued, RETENTION.cancelled_s)
    # Flagged as if a worker had claimed it and died: the next worker ends it unrun.
    flagged = await submit(aredis, prompt="flagged", max_tokens=4)
    await aredis.hset(keys.job_hash(flagged), mapping={"status": "running",
                                                       "cancel_requested": "1"})
    service = new_worker(aredis, tiny)
    task = asyncio.create_task(service.run())
    try:
        final = await final_event(aredis, flagged)
    finally:
        service.stop()
        await asyncio.wait_for(task, 10)
    assert (final["type"], final["finish_reason"]) == ("done", "cancelled")
    await assert_retained(aredis, flagged, RETENTION.cancelled_s)


async def test_a_short_final_stream_is_compacted_and_still_refuses_duplicates(
    aredis: aioredis.Redis, worker: WorkerService
) -> None:
    job_id = await submit(aredis, prompt="late", max_tokens=4, deadline_ms=1)
    assert (await final_event(aredis, job_id))["type"] == "rejected"
    stream = keys.job_events(job_id)
    # Two events in a node sized to them, not the 4 KB a new node preallocates.
    assert await aredis.xlen(stream) == 2
    assert await aredis.memory_usage(stream, samples=0) < 2048
    with pytest.raises(aioredis.ResponseError):
        await aredis.xadd(stream, {"e": "{}"}, id="2-0")
