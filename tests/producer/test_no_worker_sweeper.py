"""The no-worker sweeper against a real Redis: a job of a model no worker serves is rejected
(``no_worker``) once its deadline passed, exactly once however many API processes sweep; jobs a
live worker will read, jobs still in time and jobs already delivered are left alone."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.events.event_feed import stored_events
from tidegate.jobstore import enqueue, read_result
from tidegate.producer.no_worker_sweeper import NoWorkerSweeper
from tidegate.protocol import JobRequest, RejectedEvent, now_ms


async def job_on(aredis: aioredis.Redis, model: str, *, late: bool, lane: str = "interactive"
                 ) -> str:
    deadline = now_ms() + (-1000 if late else 60_000)
    job = JobRequest(prompt="hi", deadline_ms=deadline, lane=lane).to_job(
        model=model, default_timeout_s=60)
    assert await enqueue(aredis, job)
    return job.id


async def test_an_expired_job_of_an_unserved_model_is_rejected_no_worker(
        aredis: aioredis.Redis) -> None:
    late = await job_on(aredis, "orphan", late=True)
    batch_late = await job_on(aredis, "orphan", late=True, lane="batch")
    in_time = await job_on(aredis, "orphan", late=False)
    sweeper = NoWorkerSweeper(aredis, ["served", "orphan"], rejected_ttl_s=120)
    assert await sweeper.sweep() == 2
    for job_id in (late, batch_late):
        result = await read_result(aredis, job_id)
        assert result is not None and result.status == "rejected"
        assert result.error == {"code": "no_worker", "message": result.error["message"]}
        assert "no worker serves model 'orphan'" in result.error["message"]
        events = await stored_events(aredis, job_id)
        assert [(e.type, e.data().get("reason")) for e in events] == [
            ("queued", None), ("rejected", "no_worker")]
        RejectedEvent.model_validate_json(events[1].raw)  # what clients parse, as a worker's
        assert 0 < await aredis.ttl(keys.job_hash(job_id)) <= 120
    remaining = await aredis.xrange(keys.lane_stream("orphan", "interactive"))
    assert [json.loads(f["job"])["id"] for _, f in remaining] == [in_time]  # the rest deleted
    assert (await read_result(aredis, in_time)).status == "queued"  # type: ignore[union-attr]
    assert await sweeper.sweep() == 0


async def test_a_model_with_a_live_worker_is_left_to_it(aredis: aioredis.Redis) -> None:
    late = await job_on(aredis, "served", late=True)
    await aredis.set(keys.worker_heartbeat("w1"), json.dumps({"model": "served"}), ex=30)
    assert await NoWorkerSweeper(aredis, ["served"]).sweep() == 0
    assert (await read_result(aredis, late)).status == "queued"  # type: ignore[union-attr]
    await aredis.delete(keys.worker_heartbeat("w1"))  # the worker is gone
    assert await NoWorkerSweeper(aredis, ["served"]).sweep() == 1


async def test_only_entries_no_worker_read_are_swept(aredis: aioredis.Redis) -> None:
    stream = keys.lane_stream("gone", "interactive")
    delivered = await job_on(aredis, "gone", late=True)
    await aredis.xgroup_create(stream, keys.CONSUMER_GROUP, id="0")
    await aredis.xreadgroup(keys.CONSUMER_GROUP, "dead-worker", {stream: ">"}, count=1)
    unread = await job_on(aredis, "gone", late=True)
    assert await NoWorkerSweeper(aredis, ["gone"]).sweep() == 1
    assert (await read_result(aredis, unread)).status == "rejected"  # type: ignore[union-attr]
    # The delivered one is its (dead) worker's: reclaimed and answered by the next worker.
    assert (await read_result(aredis, delivered)).status == "queued"  # type: ignore[union-attr]


async def test_two_sweepers_reject_each_job_once(redis_url: str,
                                                 aredis: aioredis.Redis) -> None:
    jobs = [await job_on(aredis, "orphan", late=True) for _ in range(40)]
    clients = [aioredis.Redis.from_url(redis_url, decode_responses=True) for _ in range(2)]
    try:
        counts = await asyncio.gather(*(NoWorkerSweeper(c, ["orphan"]).sweep()
                                        for c in clients))
    finally:
        for c in clients:
            await c.aclose()
    assert sum(counts) == 40
    for job_id in jobs:
        events = await stored_events(aredis, job_id)
        assert [e.type for e in events] == ["queued", "rejected"]
    assert await aredis.xlen(keys.lane_stream("orphan", "interactive")) == 0


async def test_a_job_a_worker_already_claimed_is_not_rejected(aredis: aioredis.Redis) -> None:
    late = await job_on(aredis, "orphan", late=True)
    await aredis.hset(keys.job_hash(late), "status", "running")  # claimed, entry not yet read
    assert await NoWorkerSweeper(aredis, ["orphan"]).sweep() == 0
    assert await aredis.xlen(keys.lane_stream("orphan", "interactive")) == 1


async def test_jobs_routed_to_workers_all_gone_since_are_swept(aredis: aioredis.Redis) -> None:
    stream = keys.routed_stream("orphan", "interactive", "gone")
    await aredis.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    await aredis.sadd(keys.routed_streams("orphan"), stream)
    job = JobRequest(prompt="hi", deadline_ms=now_ms() - 1000).to_job(
        model="orphan", default_timeout_s=60)
    assert await enqueue(aredis, job, routed_to="gone") == 2
    assert await NoWorkerSweeper(aredis, ["orphan"]).sweep() == 1
    assert (await read_result(aredis, job.id)).status == "rejected"  # type: ignore[union-attr]
    assert await aredis.xlen(stream) == 0
