"""The gateway over real WebSockets against a real Redis: replay + live without gap or
duplicate, resume, fan-out, unknown jobs, and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.asgi_server import serve, server_errors
from tests.conftest import RedisServer
from tidegate import keys
from tidegate.events.event_log import add_event
from tidegate.jobstore import enqueue
from tidegate.protocol import DoneEvent, JobRequest, StartedEvent, Timings, TokenEvent, Usage
from tidegate.settings import Settings
from tidegate.streaming.gateway import create_app

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def gateway_server(redis_server: RedisServer) -> Iterator[str]:
    with serve(create_app(Settings(redis_url=redis_server.url))) as url:
        yield url.replace("http://", "ws://")


@pytest.fixture
def gateway(gateway_server: str, redis_url: str) -> str:
    """The gateway's ws:// base URL, over a freshly flushed Redis."""
    return gateway_server


@pytest.fixture
async def job_id(aredis: aioredis.Redis) -> str:
    """A queued job: its record and its ``queued`` event (id 1) are stored."""
    job = JobRequest(prompt="hello").to_job(model="random_tiny", default_timeout_s=60)
    await enqueue(aredis, job)
    return job.id


# ---------------------------------------------------------------- event writing, as a worker


def started(job_id: str, event_id: int = 2) -> str:
    return StartedEvent(id=event_id, job_id=job_id, worker="w1", prompt_tokens=3).model_dump_json()


def token(job_id: str, event_id: int) -> str:
    return TokenEvent(id=event_id, job_id=job_id, index=event_id - 3, text=f"t{event_id}",
                      token_ids=[event_id]).model_dump_json()


def done(job_id: str, event_id: int) -> str:
    return DoneEvent(
        id=event_id, job_id=job_id, finish_reason="length", text="...",
        usage=Usage(prompt_tokens=3, completion_tokens=event_id - 3, total_tokens=event_id),
        timings=Timings(queue_ms=1, ttft_ms=2, total_ms=3, decode_tokens_per_s=4),
    ).model_dump_json()


def job_events(job_id: str, n_tokens: int) -> list[str]:
    """Everything after ``queued``: started, ``n_tokens`` tokens, done; ids 2..n_tokens+3."""
    last = n_tokens + 3
    return [started(job_id)] + [token(job_id, i) for i in range(3, last)] + [done(job_id, last)]


async def publish(redis: aioredis.Redis, job_id: str, raws: list[str],
                  pause_s: float = 0.0) -> None:
    for raw in raws:
        pipe = redis.pipeline(transaction=True)
        add_event(pipe, job_id, raw)
        await pipe.execute()
        if pause_s:
            await asyncio.sleep(random.uniform(0, pause_s))


async def stored(redis: aioredis.Redis, job_id: str) -> list[str]:
    return [fields["e"] for _, fields in await redis.xrange(keys.job_events(job_id))]


# ---------------------------------------------------------------- reading, as a client


def stream_url(gateway: str, job_id: str, query: str = "") -> str:
    return f"{gateway}/v1/jobs/{job_id}/stream{query}"


async def read_all(ws: ClientConnection) -> tuple[list[str], int | None]:
    """Every frame until the gateway closes, and its close code."""
    frames: list[str] = []
    try:
        async with asyncio.timeout(10):
            async for raw in ws:
                frames.append(str(raw))
    except ConnectionClosed:
        pass
    return frames, ws.close_code


async def watch(url: str) -> tuple[list[str], int | None]:
    async with ws_connect(url) as ws:
        return await read_all(ws)


def ids(frames: list[str]) -> list[int]:
    return [json.loads(f)["id"] for f in frames]


async def subscribers(redis: aioredis.Redis, job_id: str) -> int:
    """Subscribers of the live channel carrying this job's events."""
    channel = keys.job_live_channel(job_id)
    return dict(await redis.pubsub_numsub(channel))[channel]


async def until_subscribers(redis: aioredis.Redis, job_id: str, n: int) -> None:
    async with asyncio.timeout(5):
        while await subscribers(redis, job_id) != n:
            await asyncio.sleep(0.01)


# ---------------------------------------------------------------- tests


async def test_client_connected_before_start_gets_every_event_verbatim(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    async with ws_connect(stream_url(gateway, job_id)) as ws:
        await until_subscribers(aredis, job_id, 1)
        await publish(aredis, job_id, job_events(job_id, 5))
        frames, code = await read_all(ws)
    assert frames == await stored(aredis, job_id)  # the exact JSON the worker wrote
    assert ids(frames) == list(range(1, 9))
    assert code == 1000


async def test_clients_joining_mid_stream_get_each_event_once_in_order(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    n_tokens = 150
    publisher = asyncio.create_task(publish(aredis, job_id, job_events(job_id, n_tokens), 0.003))
    watchers = []
    for _ in range(6):  # clients arriving at random moments while events are being written
        watchers.append(asyncio.create_task(watch(stream_url(gateway, job_id))))
        await asyncio.sleep(random.uniform(0.01, 0.06))
    await publisher
    for frames, code in await asyncio.gather(*watchers):
        assert ids(frames) == list(range(1, n_tokens + 4))
        assert code == 1000


async def test_client_after_the_job_finished_gets_the_whole_stream(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    await publish(aredis, job_id, job_events(job_id, 4))
    frames, code = await watch(stream_url(gateway, job_id))
    assert frames == await stored(aredis, job_id)
    assert code == 1000


async def test_last_event_id_resumes_after_that_event(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    await publish(aredis, job_id, job_events(job_id, 4))
    frames, code = await watch(stream_url(gateway, job_id, "?last_event_id=4"))
    assert ids(frames) == [5, 6, 7]
    assert code == 1000


async def test_many_clients_on_one_job_share_one_subscription_and_each_get_everything(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    clients = [await ws_connect(stream_url(gateway, job_id)).__aenter__() for _ in range(40)]
    # Each got ``queued`` (replayed after it was registered): all are watching now.
    assert [ids([await ws.recv()]) for ws in clients] == [[1]] * 40
    assert await subscribers(aredis, job_id) == 1  # one pub/sub subscription for all 40
    await publish(aredis, job_id, job_events(job_id, 10))
    expected = await stored(aredis, job_id)
    for ws in clients:
        frames, code = await read_all(ws)
        assert ([expected[0], *frames], code) == (expected, 1000)
    await until_subscribers(aredis, job_id, 0)


@pytest.mark.parametrize("bad_id", ["0123456789abcdef", "not%20a%20job", "x" * 65])
async def test_unknown_or_invalid_job_closes_with_4404(gateway: str, bad_id: str) -> None:
    async with ws_connect(stream_url(gateway, bad_id)) as ws:
        frames, code = await read_all(ws)
        assert (frames, code) == ([], 4404)
        assert ws.close_reason == "unknown job"


async def test_malformed_last_event_id_closes_with_4400(gateway: str, job_id: str) -> None:
    frames, code = await watch(stream_url(gateway, job_id, "?last_event_id=-1"))
    assert (frames, code) == ([], 4400)


async def test_client_leaving_mid_stream_frees_its_subscription(
        gateway: str, aredis: aioredis.Redis, job_id: str,
        caplog: pytest.LogCaptureFixture) -> None:
    raws = job_events(job_id, 6)
    async with ws_connect(stream_url(gateway, job_id)) as ws:
        await publish(aredis, job_id, raws[:3])
        assert ids([await ws.recv(), await ws.recv()]) == [1, 2]
    await until_subscribers(aredis, job_id, 0)
    await publish(aredis, job_id, raws[3:])
    frames, code = await watch(stream_url(gateway, job_id))  # the gateway still serves
    assert (ids(frames), code) == (list(range(1, 10)), 1000)
    assert server_errors(caplog.records) == []


async def test_client_leaving_a_quiet_job_frees_its_subscription(
        gateway: str, aredis: aioredis.Redis, job_id: str,
        caplog: pytest.LogCaptureFixture) -> None:
    async with ws_connect(stream_url(gateway, job_id)) as ws:
        assert ids([await ws.recv()]) == [1]  # queued, then nothing: the job waits in its lane
        await until_subscribers(aredis, job_id, 1)
    await until_subscribers(aredis, job_id, 0)
    assert server_errors(caplog.records) == []


async def test_healthz(gateway: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.get(gateway.replace("ws://", "http://") + "/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
