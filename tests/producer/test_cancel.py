"""Cancellation over real HTTP and WebSockets: a queued job ends at once as done/cancelled (its
watchers see the final event), a running one is flagged for its worker, a finished one is 409."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.jobstore import set_status
from tidegate.producer import Client, SyncClient
from tidegate.producer.errors import Conflict, JobNotFound

pytestmark = pytest.mark.timeout(30)

RESULT = {"text": "Hi", "finish_reason": "stop",
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
          "timings": {"queue_ms": 1.0, "ttft_ms": 2.0, "total_ms": 3.0,
                      "decode_tokens_per_s": 4.0}}


@pytest.fixture
async def client(stack_server: str, redis_url: str) -> AsyncIterator[Client]:
    """A client of API + gateway, over a freshly flushed Redis."""
    async with Client(stack_server) as client:
        yield client


async def mark(aredis: aioredis.Redis, job_id: str, status: str, **fields: str) -> None:
    """Change the job's status as a worker would."""
    pipe = aredis.pipeline(transaction=True)
    set_status(pipe, job_id, status, **fields)
    await pipe.execute()


async def test_cancelling_a_queued_job_ends_its_stream_as_cancelled(client: Client) -> None:
    handle = await client.submit("hello")
    events = handle.events()
    async with contextlib.aclosing(events):
        assert (await anext(events)).type == "queued"  # watching, live, before the cancel
        assert await handle.cancel() == "cancelled"
        done = await anext(events)
        with pytest.raises(StopAsyncIteration):
            await anext(events)
    assert (done.type, done.finish_reason, done.text) == ("done", "cancelled", "")  # type: ignore[union-attr]
    result = await client.get(handle.id)
    assert (result.status, result.finish_reason, result.text) == ("done", "cancelled", "")


async def test_a_running_job_is_flagged_for_its_worker(
        client: Client, aredis: aioredis.Redis) -> None:
    handle = await client.submit("hello")
    await mark(aredis, handle.id, "running", worker="w1")
    assert await handle.cancel() == "cancelling"
    assert await client.cancel(handle.id) == "cancelling"  # asking again changes nothing
    record = await aredis.hgetall(keys.job_hash(handle.id))
    assert (record["status"], record["cancel_requested"]) == ("running", "1")
    assert await aredis.xlen(keys.job_events(handle.id)) == 1  # the worker writes the end


async def test_a_finished_job_is_409_with_its_status(
        stack_server: str, client: Client, aredis: aioredis.Redis) -> None:
    handle = await client.submit("hello")
    await mark(aredis, handle.id, "done", result=json.dumps(RESULT))
    async with httpx.AsyncClient(base_url=stack_server) as http:
        response = await http.post(f"/v1/jobs/{handle.id}/cancel")
    assert response.status_code == 409
    error = response.json()["error"]
    assert (error["type"], error["status"]) == ("conflict", "done")
    with pytest.raises(Conflict) as info:
        await handle.cancel()
    assert (info.value.status, info.value.job_status) == (409, "done")
    assert (await client.get(handle.id)).finish_reason == "stop"  # untouched


async def test_cancelling_twice_is_409_the_second_time(client: Client) -> None:
    handle = await client.submit("hello")
    assert await handle.cancel() == "cancelled"
    with pytest.raises(Conflict) as info:
        await handle.cancel()
    assert info.value.job_status == "done"


async def test_cancelling_an_unknown_job_is_404(client: Client) -> None:
    for job_id in ("0123456789abcdef", "not.a.job"):
        with pytest.raises(JobNotFound):
            await client.cancel(job_id)


async def test_the_answer_is_202_with_the_id_and_status(stack_server: str, client: Client) -> None:
    handle = await client.submit("hello")
    async with httpx.AsyncClient(base_url=stack_server) as http:
        response = await http.post(f"/v1/jobs/{handle.id}/cancel")
    assert (response.status_code, response.json()) == (202, {"id": handle.id,
                                                             "status": "cancelled"})


async def test_sync_client_cancels(stack_server: str, redis_url: str) -> None:
    def script() -> tuple[str, str, str]:
        with SyncClient(stack_server) as client:
            first, second = client.submit("one"), client.submit("two")
            return first.cancel(), client.cancel(second.id), client.get(second.id).finish_reason

    assert await asyncio.wait_for(asyncio.to_thread(script), 20) == (
        "cancelled", "cancelled", "cancelled")
