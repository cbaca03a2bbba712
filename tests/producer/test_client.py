"""Client and SyncClient over real HTTP and WebSocket, against the API and the gateway on one
port (as ``tidegate up`` serves them), a real Redis, and a fake worker that writes events the
way the real one does."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from tests.asgi_server import serve
from tests.conftest import free_port
from tidegate import keys
from tidegate.events.event_log import add_event
from tidegate.jobstore import JOB_FIELD, set_status
from tidegate.producer import Client, SyncClient
from tidegate.producer.errors import InvalidRequest, JobNotFound, ServiceUnavailable
from tidegate.protocol import (
    DoneEvent,
    Job,
    StartedEvent,
    Timings,
    TokenEvent,
    Usage,
    is_final,
)

pytestmark = pytest.mark.timeout(30)


class FakeWorker:
    """Serves the interactive lane as the real worker writes events: ``started``, one
    ``token`` per word of the prompt, then ``done`` with the result in the same transaction."""

    def __init__(self, redis: aioredis.Redis, token_pause_s: float = 0.002):
        self.redis = redis
        self.token_pause_s = token_pause_s

    async def run(self) -> None:
        last = "0"
        while True:
            for _, entries in await self.redis.xread(
                    {keys.lane_stream("random_tiny", "interactive"): last}, block=1000):
                for entry_id, fields in entries:
                    last = entry_id
                    await self.serve(Job.model_validate_json(fields[JOB_FIELD]))

    async def serve(self, job: Job) -> None:
        prompt = job.prompt if job.prompt is not None else job.messages[-1].content  # type: ignore[index]
        words = [w + " " for w in prompt.split()]
        await self.emit(StartedEvent(id=2, job_id=job.id, worker="fake",
                                     prompt_tokens=len(words)), status="running")
        for i, word in enumerate(words):
            await self.emit(TokenEvent(id=3 + i, job_id=job.id, index=i, text=word,
                                       token_ids=[i]))
            await asyncio.sleep(self.token_pause_s)
        usage = Usage(prompt_tokens=len(words), completion_tokens=len(words),
                      total_tokens=2 * len(words))
        timings = Timings(queue_ms=1, ttft_ms=2, total_ms=3, decode_tokens_per_s=4)
        done = DoneEvent(id=3 + len(words), job_id=job.id, finish_reason="stop",
                         text="".join(words), usage=usage, timings=timings)
        result = done.model_dump_json(include={"text", "finish_reason", "usage", "timings"})
        await self.emit(done, status="done", result=result)

    async def emit(self, event: StartedEvent | TokenEvent | DoneEvent, status: str | None = None,
                   **fields: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        add_event(pipe, event.job_id, event.model_dump_json())
        if status is not None:
            set_status(pipe, event.job_id, status, **fields)
        await pipe.execute()


@pytest.fixture
async def worker(aredis: aioredis.Redis) -> AsyncIterator[FakeWorker]:
    fake = FakeWorker(aredis)
    task = asyncio.create_task(fake.run())
    yield fake
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# ---------------------------------------------------------------- Client


async def test_events_arrive_in_order_and_result_matches(stack: str, worker: FakeWorker) -> None:
    async with Client(stack) as client:
        handle = await client.submit("the quick brown fox", max_tokens=16, seed=7)
        assert handle.stream_url == f"{stack.replace('http', 'ws')}/v1/jobs/{handle.id}/stream"
        events = [event async for event in handle.events()]
        result = await handle.result(timeout_s=5)
        assert await client.get(handle.id) == result
    assert [e.type for e in events] == ["queued", "started"] + ["token"] * 4 + ["done"]
    assert [e.id for e in events] == list(range(1, 8))
    assert "".join(e.text for e in events if e.type == "token") == "the quick brown fox "
    assert (result.status, result.text, result.finish_reason) == ("done", "the quick brown fox ", "stop")
    assert result.usage is not None and result.usage.total_tokens == 8


async def test_result_waits_for_the_job_to_finish(stack: str, worker: FakeWorker) -> None:
    async with Client(stack) as client:
        handle = await client.submit(messages=[{"role": "user", "content": "one two"}])
        result = await handle.result(timeout_s=5)
    assert (result.status, result.text) == ("done", "one two ")


async def test_events_of_a_finished_job_are_replayed(stack: str, worker: FakeWorker) -> None:
    async with Client(stack) as client:
        handle = await client.submit("a b c")
        await handle.result(timeout_s=5)
        later = client.handle(handle.id)  # by id alone, as another process would
        events = [event async for event in later.events()]
        resumed = [event.id async for event in later.events(after_id=4)]
    assert [e.id for e in events] == list(range(1, 7)) and is_final(events[-1])
    assert resumed == [5, 6]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({}, "prompt"),
     ({"prompt": "x", "lane": "vip"}, "lane"), ({"prompt": "x", "temperature": 9}, "temperature")],
)
async def test_bad_params_raise_before_any_network_call(kwargs: dict, field: str) -> None:
    async with Client(f"http://127.0.0.1:{free_port()}") as client:  # nothing listens there
        with pytest.raises(InvalidRequest) as info:
            await client.submit(**kwargs)
    assert field in [f["field"] for f in info.value.fields]


async def test_a_prompt_over_the_context_is_refused_by_the_server(
        stack: str, aredis: aioredis.Redis) -> None:
    async with Client(stack) as client:
        with pytest.raises(InvalidRequest) as info:
            await client.submit("x" * 3000)
    assert (info.value.status, info.value.type) == (422, "context_length_exceeded")
    assert [f["field"] for f in info.value.fields] == ["prompt"]
    assert await aredis.dbsize() == 0


async def test_unknown_jobs_raise_job_not_found(stack: str) -> None:
    async with Client(stack) as client:
        with pytest.raises(JobNotFound):
            await client.get("0123456789abcdef")
        with pytest.raises(JobNotFound):
            async for _ in client.handle("0123456789abcdef").events():
                pass


async def test_an_unreachable_service_raises_service_unavailable() -> None:
    async with Client(f"http://127.0.0.1:{free_port()}", timeout_s=2) as client:
        with pytest.raises(ServiceUnavailable):
            await client.submit("hi")


async def test_events_resume_after_a_dropped_connection() -> None:
    """A gateway that drops the first connection (1011) after two events: the client
    reconnects with ``last_event_id`` and gets the rest once each."""
    frames = [json.dumps({"type": "token", "id": i, "job_id": "j", "index": i - 1,
                          "text": str(i), "token_ids": [i]}) for i in range(1, 5)]
    frames.append(json.dumps({"type": "error", "id": 5, "job_id": "j", "code": "x",
                              "message": "y"}))
    seen_after: list[int] = []

    async def flaky(ws: WebSocket) -> None:
        await ws.accept()
        after = int(ws.query_params.get("last_event_id", 0))
        seen_after.append(after)
        for raw in frames[after:after + 2] if not after else frames[after:]:
            await ws.send_text(raw)
        await ws.close(1011 if not after else 1000)

    with serve(Starlette(routes=[WebSocketRoute("/s", flaky)])) as url:
        async with Client(url) as client:
            handle = client.handle("j", url.replace("http", "ws") + "/s")
            ids = [event.id async for event in handle.events()]
    assert (ids, seen_after) == ([1, 2, 3, 4, 5], [0, 2])


# ---------------------------------------------------------------- SyncClient


async def test_sync_client_submits_streams_and_reads_results(
        stack: str, worker: FakeWorker) -> None:
    def script() -> None:  # what a synchronous caller writes; the fake worker runs meanwhile
        with SyncClient(stack) as client:
            handle = client.submit("hello sync world", max_tokens=8)
            events = list(handle.events())
            assert [e.id for e in events] == list(range(1, 7)) and events[-1].type == "done"
            result = handle.result(timeout_s=5)
            assert (result.status, result.text) == ("done", "hello sync world ")
            assert client.get(handle.id) == result
            with pytest.raises(InvalidRequest):
                client.submit("x", max_tokens=0)
            with pytest.raises(JobNotFound):
                client.get("0123456789abcdef")

    await asyncio.wait_for(asyncio.to_thread(script), 20)


async def test_sync_events_can_be_left_early(stack: str, worker: FakeWorker) -> None:
    def script() -> int:
        with SyncClient(stack) as client:
            handle = client.submit("w " * 50)
            for event in handle.events():
                if event.type == "token":
                    return event.id
        return 0

    assert await asyncio.wait_for(asyncio.to_thread(script), 20) == 3
