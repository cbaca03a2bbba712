"""The gateway against hostile clients (issue 14): close reasons of non-ASCII text, bad frames
while a job streams, oversized handshakes, and clients that stop reading."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect

from streaming.gateway import create_app
from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.streaming.test_gateway import ids, read_all, stream_url
from tidegate.jobstore import enqueue
from tidegate.protocol import JobRequest
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(60)


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
