"""Prefix routing's queue side against a real redis-server: the enqueue script's choice of
stream, a worker's own stream read first, stealing only what waited past the delay, reclaiming
from a dead worker's stream, forgetting departed workers' empty streams, the backlog and the
queue view counting routed jobs, and a worker's announcements routing a prompt back to it."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.jobstore import enqueue
from tidegate.operations.queue_stats import ROUTED, queue_stats
from tidegate.producer.submit.backlog import LaneBacklog
from tidegate.producer.submit.prefix_router import PrefixRouter, Route
from tidegate.protocol import JobRequest
from tidegate.routing.cache_announcement import FORGET_AFTER_S, CacheAnnouncement, read_table
from tidegate.worker.engine.engine import Engine, EngineConfig
from tidegate.worker.models.loaders.loader import LoadedModel, load_model
from tidegate.worker.service.cache_announcer import CacheAnnouncer
from tidegate.worker.service.intake import StreamIntake
from tidegate.worker.service.service import WorkerService

MODEL = "random_tiny"


def job(prompt: str = "hello", **body: object):  # noqa: ANN201
    return JobRequest.model_validate({"prompt": prompt, **body}).to_job(
        model=MODEL, default_timeout_s=60)


async def intake(aredis: aioredis.Redis, worker_id: str, *, delay_ms: int = 100
                 ) -> StreamIntake:
    streams = StreamIntake(aredis, worker_id, model=MODEL, routing=True, steal_delay_ms=delay_ms)
    await streams.ensure_groups()
    return streams


async def test_a_routed_job_goes_to_its_workers_stream_if_it_exists(
        aredis: aioredis.Redis) -> None:
    await intake(aredis, "wa")
    assert await enqueue(aredis, job(), routed_to="wa") == 2
    assert await aredis.xlen(keys.routed_stream(MODEL, "interactive", "wa")) == 1
    assert await enqueue(aredis, job(), routed_to="gone") == 1  # no such stream: the lane
    assert await aredis.xlen(keys.lane_stream(MODEL, "interactive")) == 1
    assert not await aredis.exists(keys.routed_stream(MODEL, "interactive", "gone"))
    first = job()
    assert await enqueue(aredis, first, routed_to="wa") == 2
    assert await enqueue(aredis, first, routed_to="wa") == 0  # its record exists: nothing


async def test_a_worker_reads_its_own_stream_first_then_the_lane(aredis: aioredis.Redis) -> None:
    a = await intake(aredis, "wa")
    await enqueue(aredis, shared := job("shared"))
    await enqueue(aredis, mine := job("mine"), routed_to="wa")
    batch = job("batch", lane="batch")
    await enqueue(aredis, batch, routed_to="wa")
    got = await a.read(1, block_ms=0)
    assert [d.job.id for d in got if d.job] == [mine.id]
    got = await a.read(5, block_ms=0)
    assert [d.job.id for d in got if d.job] == [shared.id, batch.id]  # interactive lane first
    assert a.taken == {"routed": 2, "shared": 1}


async def test_only_jobs_that_waited_the_delay_are_stolen_and_never_twice(
        aredis: aioredis.Redis) -> None:
    a, b = await intake(aredis, "wa", delay_ms=150), await intake(aredis, "wb", delay_ms=150)
    old = job("old")
    await enqueue(aredis, old, routed_to="wa")
    assert await b.steal(5) == []  # fresh: its owner may still take it
    await asyncio.sleep(0.2)
    fresh = job("fresh")
    await enqueue(aredis, fresh, routed_to="wa")
    stolen = await b.steal(5)
    assert [d.job.id for d in stolen if d.job] == [old.id]
    assert stolen[0].stream == keys.routed_stream(MODEL, "interactive", "wa")
    assert [d.job.id for d in await a.read(5, block_ms=0) if d.job] == [fresh.id]
    await asyncio.sleep(0.2)
    assert await b.steal(5) == []  # the owner took the rest
    assert b.taken == {"stolen": 1} and a.taken == {"routed": 1}


async def test_a_thief_takes_the_interactive_lane_first_and_at_most_count(
        aredis: aioredis.Redis) -> None:
    await intake(aredis, "wa", delay_ms=0)
    b = await intake(aredis, "wb", delay_ms=0)
    batch = [job(f"b{i}", lane="batch") for i in range(2)]
    inter = [job(f"i{i}") for i in range(2)]
    for j in [*batch, *inter]:
        await enqueue(aredis, j, routed_to="wa")
    got = await b.steal(3)
    assert [d.job.id for d in got if d.job] == [inter[0].id, inter[1].id, batch[0].id]


async def test_a_dead_workers_running_jobs_are_reclaimed_from_its_stream(
        aredis: aioredis.Redis) -> None:
    a, b = await intake(aredis, "wa"), await intake(aredis, "wb")
    await enqueue(aredis, running := job("running"), routed_to="wa")
    assert len(await a.read(1, block_ms=0)) == 1  # wa took it, then died
    await asyncio.sleep(0.06)
    got = await b.reclaim(5, min_idle_ms=50)
    assert [d.job.id for d in got if d.job] == [running.id] and got[0].attempt == 2
    assert b.taken == {"reclaimed": 1}


async def test_departed_workers_empty_streams_are_forgotten_and_jobs_fall_back(
        aredis: aioredis.Redis) -> None:
    live, gone, busy = [await intake(aredis, w) for w in ("live", "gone", "busy")]
    await enqueue(aredis, job(), routed_to="busy")  # still holds a job: kept
    long_ago = int((time.time() - FORGET_AFTER_S - 5) * 1000)
    for w in ("gone", "busy"):
        record = CacheAnnouncement(w, 16, 4, 0, 0, long_ago - 10_000, long_ago, 1)
        await aredis.hset(keys.routing_table(MODEL), w, record.to_json())
    tiny = load_model("random:tiny")
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, max_num_seqs=4))
    announcer = CacheAnnouncer(aredis, engine, model=MODEL, worker_id="live",
                               own_streams=list(live.own), busy=lambda: 0)
    assert await announcer.announce_once(force=True)
    dropped = await announcer.forget_departed()
    holding = keys.routed_stream(MODEL, "interactive", "busy")
    assert sorted(dropped) == sorted([*gone.own, *(s for s in busy.own if s != holding)])
    assert set(await read_table(aredis, MODEL)) == {"live"}
    members = await aredis.smembers(keys.routed_streams(MODEL))
    assert members == {*live.own, holding}
    assert await enqueue(aredis, job(), routed_to="gone") == 1  # a stale route: the lane


async def test_the_backlog_and_the_queue_view_count_routed_jobs(aredis: aioredis.Redis) -> None:
    await intake(aredis, "wa")
    for i in range(3):
        await enqueue(aredis, job(f"r{i}"), routed_to="wa")
    await enqueue(aredis, job("lane"))
    backlog = LaneBacklog(max_backlog=10)
    assert await backlog.backlog(aredis, MODEL, "interactive") == 4
    stats = await queue_stats(aredis, models=[MODEL])
    [routed] = [s for s in stats.lanes if s.partition == ROUTED and s.lane == "interactive"]
    assert (routed.lag, routed.pending) == (3, 0)
    assert routed.stream == keys.routed_stream(MODEL, "interactive", "*")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("random:tiny")


async def test_a_workers_announcements_route_a_shared_prompt_back_to_it(
        aredis: aioredis.Redis, tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer,
                    EngineConfig(max_model_len=512, max_num_seqs=4, block_size=16))
    service = WorkerService(aredis, engine, model=MODEL, worker_id="w-announcing",
                            prefix_routing=True)
    task = asyncio.create_task(service.run())
    try:
        system = "You are a careful assistant who answers in one short sentence. " * 3
        await enqueue(aredis, job(system + "first?", max_tokens=2))
        ids = tiny.tokenizer.encode_prompt(system + "second?", None)

        async def route() -> Route:  # a fresh router: no prediction of its own
            router = PrefixRouter()
            await router.refresh(aredis, MODEL)
            return router.route(ids)

        deadline = time.monotonic() + 30
        while (got := await route()).kind != "cached":
            assert time.monotonic() < deadline, await read_table(aredis, MODEL)
            await asyncio.sleep(0.1)
        assert got.worker_id == "w-announcing" and got.matched_blocks >= len(system) // 16 - 1
    finally:
        service.stop()
        await asyncio.wait_for(task, 10)
    assert await read_table(aredis, MODEL) == {}  # withdrawn on the way out
