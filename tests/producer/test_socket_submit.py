"""``WS /v1/stream``: submit over the socket and receive the job's events on it, with the HTTP
API's validation and auth, and resume by a first frame. A test task plays the worker: it writes
events for the job the socket created, exactly as a worker does (stream, then channel)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import RedisServer
from tests.producer.conftest import serve_stack
from tests.streaming.test_gateway import job_events, publish
from tidegate import keys
from tidegate.producer.submit.admission import Admission
from tidegate.protocol import Job

pytestmark = pytest.mark.timeout(30)
KEY = "sk-socket-test-key-1"
MSG = [{"role": "user", "content": "hi"}]


async def frames_until_close(ws) -> tuple[list[dict], int | None]:  # noqa: ANN001
    frames = []
    try:
        async with asyncio.timeout(10):
            async for raw in ws:
                frames.append(json.loads(raw))
    except ConnectionClosed:
        pass
    return frames, ws.close_code


async def test_generate_frame_enqueues_and_streams_the_job_on_the_same_socket(
        stack: str, aredis: aioredis.Redis) -> None:
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "generate",
                                  "request": {"messages": MSG, "max_tokens": 5}}))
        accepted = json.loads(await ws.recv())
        assert accepted["type"] == "accepted" and accepted["status"] == "queued"
        job_id = accepted["id"]
        [(_, fields)] = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
        assert Job.model_validate_json(fields["job"]).id == job_id
        assert json.loads(await ws.recv())["type"] == "queued"
        await publish(aredis, job_id, job_events(job_id, 5))
        frames, code = await frames_until_close(ws)
    assert [f["id"] for f in frames] == list(range(2, 9)) and frames[-1]["type"] == "done"
    assert code == 1000


@pytest.mark.parametrize("request_body", [
    {"prompt": ""}, {"prompt": "x", "colour": "blue"}, {"prompt": "x", "max_tokens": 2048},
    {"messages": [{"role": "wizard", "content": "x"}]}, [1, 2],
])
async def test_invalid_requests_get_the_http_apis_error_and_4400(
        stack: str, aredis: aioredis.Redis, request_body: object) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        http_answer = await http.post(f"{stack}/v1/jobs", json=request_body)
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "generate", "request": request_body}))
        frames, code = await frames_until_close(ws)
    assert code == 4400
    [error] = frames
    assert error["type"] == "error" and error["status"] == http_answer.status_code == 422
    assert error["error"] == http_answer.json()["error"]
    assert await aredis.dbsize() == 0


@pytest.mark.parametrize(("frame", "field"), [
    ("{not json", "frame"),
    ('{"type": "subscribe"}', "type"),
    ('{"type": "generate", "request": {"prompt": "x"}, "extra": 1}', "extra"),
    ('{"type": "resume", "job_id": "../etc", "last_event_id": 0}', "job_id"),
    ('{"type": "resume", "job_id": "abc", "last_event_id": -2}', "last_event_id"),
])
async def test_malformed_first_frames_name_the_field(stack: str, frame: str, field: str) -> None:
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(frame)
        frames, code = await frames_until_close(ws)
    assert code == 4400
    assert frames[0]["error"]["fields"][0]["field"] == field


async def test_resume_frame_continues_after_the_last_event_received(
        stack: str, aredis: aioredis.Redis) -> None:
    base = stack.replace("http", "ws") + "/v1/stream"
    async with ws_connect(base) as ws:
        await ws.send(json.dumps({"type": "generate", "request": {"prompt": "hi"}}))
        accepted = json.loads(await ws.recv())
        job_id, token = accepted["id"], accepted["stream_token"]
        await publish(aredis, job_id, job_events(job_id, 6)[:3])
        got = [json.loads(await ws.recv())["id"] for _ in range(3)]
    assert got == [1, 2, 3]
    await publish(aredis, job_id, job_events(job_id, 6)[3:])
    async with ws_connect(base) as ws:
        await ws.send(json.dumps({"type": "resume", "job_id": job_id, "last_event_id": 3,
                                  "token": token}))
        frames, code = await frames_until_close(ws)
    assert [f["id"] for f in frames] == list(range(4, 10)) and code == 1000


async def test_keys_in_the_first_frame_or_the_header(
        redis_server: RedisServer, admission: Admission, redis_url: str) -> None:
    with serve_stack(redis_server, admission, api_keys=[KEY]) as url:
        base = url.replace("http", "ws") + "/v1/stream"
        generate = {"type": "generate", "request": {"prompt": "hi"}}
        async with ws_connect(base) as ws:
            await ws.send(json.dumps(generate))
            frames, code = await frames_until_close(ws)
        assert code == 4401 and frames[0]["status"] == 401
        async with ws_connect(base) as ws:
            await ws.send(json.dumps({**generate, "api_key": "sk-wrong"}))
            frames, code = await frames_until_close(ws)
        assert code == 4401
        async with ws_connect(base) as ws:
            await ws.send(json.dumps({**generate, "api_key": KEY}))
            assert json.loads(await ws.recv())["type"] == "accepted"
        async with ws_connect(base, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.send(json.dumps(generate))
            accepted = json.loads(await ws.recv())
            assert accepted["type"] == "accepted"
        # Resuming someone's job needs its token or the owner's key.
        async with ws_connect(base) as ws:
            await ws.send(json.dumps({"type": "resume", "job_id": accepted["id"],
                                      "token": "wrong"}))
            frames, code = await frames_until_close(ws)
        assert code == 4403
        async with ws_connect(base) as ws:
            await ws.send(json.dumps({"type": "resume", "job_id": accepted["id"],
                                      "token": accepted["stream_token"]}))
            assert json.loads(await ws.recv())["type"] == "queued"


async def test_a_full_lane_is_refused_with_429_and_4429(
        redis_server: RedisServer, admission: Admission, redis_url: str) -> None:
    with serve_stack(redis_server, admission, max_backlog=1) as url:
        base = url.replace("http", "ws") + "/v1/stream"
        generate = json.dumps({"type": "generate", "request": {"prompt": "hi"}})
        async with ws_connect(base) as ws:
            await ws.send(generate)
            assert json.loads(await ws.recv())["type"] == "accepted"
        async with ws_connect(base) as ws:
            await ws.send(generate)
            frames, code = await frames_until_close(ws)
    assert code == 4429
    assert frames[0]["status"] == 429 and frames[0]["error"]["type"] == "queue_full"
