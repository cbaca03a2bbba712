"""The API against hostile clients (issue 14): ``WS /v1/stream`` refusals whose reason is
non-ASCII text still close with their code (the reason cut to the protocol's 123 bytes), and
OpenAI streams whose clients leave at once still cancel their jobs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect

from tests.conftest import RedisServer
from tests.producer.conftest import serve_stack
from tests.producer.openai_compat.test_openai_api import ScriptedWorker
from tests.producer.test_socket_submit import frames_until_close
from tidegate import keys
from tidegate.producer.submit.admission import Admission

pytestmark = pytest.mark.timeout(30)


async def test_a_refusal_naming_non_ascii_input_still_closes_with_4400(stack: str) -> None:
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "générer" * 30}))
        frames, code = await frames_until_close(ws)
        reason = ws.close_reason or ""
    assert code == 4400
    assert frames[0]["error"]["fields"][0]["field"] == "type"
    assert frames[0]["error"]["message"].startswith(reason)
    assert 100 < len(reason.encode()) <= 123


@pytest.fixture(scope="module")
def openai_server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    with serve_stack(redis_server, admission) as url:
        yield url


async def test_streams_whose_clients_leave_at_once_all_cancel_their_jobs(
        openai_server: str, redis_url: str, aredis: aioredis.Redis) -> None:
    """Each client sends its request and hangs up: the answer is cancelled while it subscribes
    and replays, inside Redis commands, where one cancel() can be lost (Python 3.11's wait_for
    in redis-py). Every job must still be cancelled, not served to nobody until it ends."""
    worker = ScriptedWorker(aredis)  # ``slow``: a token every 0.2 s until cancelled
    serving = asyncio.create_task(worker.run())
    host, port = openai_server.removeprefix("http://").split(":")
    body = json.dumps({"model": "tidegate", "prompt": "slow " + "word " * 200,
                       "max_tokens": 200, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
               ).encode() + body

    async def send_and_leave() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    try:
        for _ in range(3):
            await asyncio.gather(*(send_and_leave() for _ in range(8)))
        async with asyncio.timeout(10):
            while len(ids := await job_ids(aredis)) < 24:
                await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        requested = [await aredis.hget(keys.job_hash(i), "cancel_requested") for i in ids]
    finally:
        for task in [serving, *worker.jobs]:
            task.cancel()
        await asyncio.gather(serving, *worker.jobs, return_exceptions=True)
    assert requested == ["1"] * 24, requested


async def job_ids(aredis: aioredis.Redis) -> list[str]:
    entries = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    return [json.loads(fields["job"])["id"] for _, fields in entries]
