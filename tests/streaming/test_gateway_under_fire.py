"""The gateway against hostile clients (issue 14): close reasons of non-ASCII text, bad frames
while a job streams, oversized handshakes, and clients that stop reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from streaming.gateway import create_app
from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.streaming.test_gateway import ids, publish, read_all, started, stream_url, token
from tidegate.jobstore import enqueue
from tidegate.protocol import JobRequest
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(60)


async def frames_for(ws: ClientConnection, seconds: float) -> tuple[list[str], int | None]:
    """The frames received within ``seconds`` and the close code (None: still open)."""
    frames: list[str] = []
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        async with asyncio.timeout(seconds):
            async for raw in ws:
                frames.append(str(raw))
    return frames, ws.close_code


@pytest.fixture(scope="module")
def gateway_http(redis_server: RedisServer) -> Iterator[str]:
    with serve(create_app(Settings(redis_url=redis_server.url))) as url:
        yield url


@pytest.fixture
def gateway(gateway_http: str, redis_url: str) -> str:
    """The gateway's ws:// base URL, over a freshly flushed Redis."""
    return gateway_http.replace("http://", "ws://")


@pytest.fixture
async def job_id(aredis: aioredis.Redis) -> str:
    job = JobRequest(prompt="hello").to_job(default_timeout_s=60)
    await enqueue(aredis, job)
    return job.id


async def test_a_non_ascii_close_reason_is_cut_to_123_bytes_and_still_4400(
        gateway: str, job_id: str) -> None:
    async with ws_connect(stream_url(gateway, job_id)) as ws:
        assert ids([await ws.recv()]) == [1]
        await ws.send(json.dumps({"type": "ü" * 100}))  # named in the reason: 200+ bytes
        frames, code = await read_all(ws)
        reason = ws.close_reason or ""
    assert code == 4400
    error = json.loads(frames[-1])
    assert error["code"] == "bad_frame" and error["message"].startswith(reason)
    assert 100 < len(reason.encode()) <= 123 and "üü" in reason


async def test_a_bad_frame_while_the_job_streams_is_refused_on_every_connection(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    """The bad frame arrives while the relay replays the stream: its sender is inside a Redis
    command, where one cancel() can be lost (Python 3.11's wait_for in redis-py). Every
    connection must still be refused at once, not after the job's last token."""
    await publish(aredis, job_id, [started(job_id)])
    streaming = asyncio.Event()
    streaming.set()

    async def stream_tokens() -> None:  # a token every ~2 ms until the clients are done
        event_id = 3
        while streaming.is_set() and event_id < 5000:
            await publish(aredis, job_id, [token(job_id, event_id)])
            event_id += 1
            await asyncio.sleep(0.002)

    async def send_bad_frame() -> tuple[list[str], int | None, float]:
        async with ws_connect(stream_url(gateway, job_id)) as ws:
            sent = time.monotonic()
            await ws.send('{"type": "subscribe"}')
            frames, code = await frames_for(ws, 3.0)
            return frames, code, time.monotonic() - sent

    publisher = asyncio.create_task(stream_tokens())
    try:
        results = []
        for _ in range(4):  # 4 rounds of 6 connections at once
            results += await asyncio.gather(*(send_bad_frame() for _ in range(6)))
    finally:
        streaming.clear()
        await publisher
    codes = [code for _, code, _ in results]
    assert codes == [4400] * len(results), codes
    for frames, _, took_s in results:
        assert json.loads(frames[-1])["code"] == "bad_frame"
        assert took_s < 2.0, took_s
