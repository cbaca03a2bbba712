"""Producer-side backpressure against a real Redis: a lane whose backlog (consumer-group lag +
pending, or the stream's length before any worker joined) reaches ``max_backlog`` refuses
submits with 429 and Retry-After until the workers catch up; other lanes are unaffected."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from tests.conftest import RedisServer, free_port
from tests.producer.conftest import serve_stack
from tidegate import keys
from tidegate.producer import Client
from tidegate.producer.errors import QueueFull
from tidegate.producer.submit.admission import Admission
from tidegate.producer.submit.backlog import CACHE_S, LaneBacklog, LaneFull

pytestmark = pytest.mark.timeout(30)

MAX_BACKLOG = 3
RETRY_AFTER_S = 5
LANE = keys.lane_stream("random_tiny", "interactive")


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    with serve_stack(redis_server, admission, max_backlog=MAX_BACKLOG,
                     retry_after_s=RETRY_AFTER_S) as url:
        yield url


@pytest.fixture
async def http(server: str, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        await asyncio.sleep(CACHE_S)  # let the previous test's reading of the lane expire
        yield client


async def submit(http: httpx.AsyncClient, lane: str = "interactive",
                 **headers: str) -> httpx.Response:
    return await http.post("/v1/jobs", json={"prompt": "hi", "lane": lane}, headers=headers)


async def fill(http: httpx.AsyncClient) -> list[str]:
    responses = [await submit(http) for _ in range(MAX_BACKLOG)]
    assert [r.status_code for r in responses] == [202] * MAX_BACKLOG
    return [r.json()["id"] for r in responses]


async def test_a_full_lane_is_429_with_retry_after_naming_the_lane(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    await fill(http)
    refused = await submit(http)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
    error = refused.json()["error"]
    assert (error["type"], error["lane"]) == ("queue_full", "interactive")
    assert [f["field"] for f in error["fields"]] == ["lane"] and "interactive" in error["message"]
    assert await aredis.xlen(LANE) == MAX_BACKLOG  # nothing more was written


async def test_other_lanes_are_unaffected(http: httpx.AsyncClient) -> None:
    await fill(http)
    assert (await submit(http, "batch")).status_code == 202


async def test_the_client_raises_queue_full_with_retry_after(
        server: str, http: httpx.AsyncClient) -> None:
    await fill(http)
    async with Client(server) as client:
        with pytest.raises(QueueFull) as info:
            await client.submit("hi")
    assert (info.value.status, info.value.retry_after_s) == (429, RETRY_AFTER_S)


async def test_submits_are_accepted_again_once_the_workers_ack(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    await fill(http)  # no consumer group yet: the backlog is the stream's length
    await aredis.xgroup_create(LANE, keys.CONSUMER_GROUP, id="0")
    await asyncio.sleep(CACHE_S)
    assert (await submit(http)).status_code == 429  # lag 3, pending 0

    [(_, entries)] = await aredis.xreadgroup(keys.CONSUMER_GROUP, "w1", {LANE: ">"})
    await asyncio.sleep(CACHE_S)
    assert (await submit(http)).status_code == 429  # lag 0, pending 3: still being worked on

    await aredis.xack(LANE, keys.CONSUMER_GROUP, *[entry_id for entry_id, _ in entries])
    await asyncio.sleep(CACHE_S)
    assert (await submit(http)).status_code == 202


async def test_a_repeat_of_an_accepted_submit_is_answered_even_when_full(
        http: httpx.AsyncClient) -> None:
    first = await submit(http, **{"Idempotency-Key": "before-the-rush"})
    for _ in range(MAX_BACKLOG - 1):
        assert (await submit(http)).status_code == 202
    assert (await submit(http)).status_code == 429
    again = await submit(http, **{"Idempotency-Key": "before-the-rush"})
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json()["id"] == first.json()["id"]


# ---------------------------------------------------------------- LaneBacklog


async def add_jobs(aredis: aioredis.Redis, n: int, partition: int = 0) -> None:
    for _ in range(n):
        await aredis.xadd(keys.lane_stream("m", "batch", partition), {"job": "{}"})


async def test_a_reading_is_cached_and_counts_this_process_s_submits(
        redis_url: str, aredis: aioredis.Redis) -> None:
    backlog = LaneBacklog(max_backlog=5, cache_s=60)
    assert await backlog.backlog(aredis, "m", "batch") == 0  # the stream does not exist yet
    await add_jobs(aredis, 4)
    assert await backlog.backlog(aredis, "m", "batch") == 0  # cached: no read within cache_s
    backlog.note_enqueued("m", "batch")
    assert await backlog.backlog(aredis, "m", "batch") == 1


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[aioredis.Redis]:
    """A redis-server of this test's own: its command counters are server-wide, and the
    session's server also serves what other tests of this process left running (a module's
    stack, whose processes read the same streams)."""
    server = RedisServer(port=free_port(), workdir=tmp_path)
    server.start()
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()
        server.stop()


async def test_concurrent_checks_share_one_read(own_redis: aioredis.Redis) -> None:
    aredis = own_redis
    await add_jobs(aredis, 2)
    backlog = LaneBacklog(max_backlog=5, cache_s=60)
    before = (await aredis.info("commandstats")).get("cmdstat_xinfo|groups", {}).get("calls", 0)
    readings = await asyncio.gather(*(backlog.backlog(aredis, "m", "batch") for _ in range(20)))
    after = (await aredis.info("commandstats")).get("cmdstat_xinfo|groups", {}).get("calls", 0)
    assert readings == [2] * 20 and after - before == 1


async def test_partitions_are_summed(redis_url: str, aredis: aioredis.Redis) -> None:
    await add_jobs(aredis, 2, partition=0)
    await add_jobs(aredis, 3, partition=1)
    backlog = LaneBacklog(max_backlog=5, partitions=2, retry_after_s=7)
    with pytest.raises(LaneFull) as info:
        await backlog.check(aredis, "m", "batch")
    assert (info.value.backlog, info.value.retry_after_s) == (5, 7)
    await LaneBacklog(max_backlog=6, partitions=2).check(aredis, "m", "batch")  # fits


async def test_each_model_has_its_own_backlog(redis_url: str, aredis: aioredis.Redis) -> None:
    await add_jobs(aredis, 5)  # model "m" is full; model "other" is not
    backlog = LaneBacklog(max_backlog=5)
    with pytest.raises(LaneFull) as info:
        await backlog.check(aredis, "m", "batch")
    assert info.value.model == "m" and "'m'" in str(info.value)
    await backlog.check(aredis, "other", "batch")
