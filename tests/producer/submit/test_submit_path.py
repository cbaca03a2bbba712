"""The fast submit path: one enqueue script per job (the queued event as entry 1-0, nothing
written twice), the submit path's Redis commands batched across concurrent submits (each
caller gets its own answer or error), short prompts admitted on the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.producer.conftest import MODEL
from tidegate import keys
from tidegate.commands.cli import build_parser
from tidegate.jobstore import enqueue
from tidegate.producer.submit.admission import INLINE_PROMPT_CHARS, Admission
from tidegate.producer.submit.batched import Batched
from tidegate.producer.submit.refusal import Refusal
from tidegate.producer.submit.submit_path import SubmitPath
from tidegate.protocol import ChatMessage, Job, JobRequest
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(60)


def new_job(prompt: str = "hello") -> Job:
    return JobRequest(prompt=prompt, max_tokens=8).to_job(model="random_tiny", default_timeout_s=60)


async def test_enqueue_writes_the_record_the_queued_event_as_1_0_then_the_lane_entry(
        aredis: aioredis.Redis) -> None:
    job = new_job()
    assert await enqueue(aredis, job, ttl_s=600, owner="tenant-a", stream_token_hash="ab" * 32)
    record = await aredis.hgetall(keys.job_hash(job.id))
    assert record == {"job": job.model_dump_json(), "status": "queued", "owner": "tenant-a",
                      "stream_token_hash": "ab" * 32}
    [(entry_id, event)] = await aredis.xrange(keys.job_events(job.id))
    assert entry_id == "1-0"
    assert json.loads(event["e"]) == {"id": 1, "job_id": job.id, "type": "queued",
                                      "lane": "interactive"}
    for key in (keys.job_hash(job.id), keys.job_events(job.id)):
        assert 590 < await aredis.ttl(key) <= 600
    [(_, fields)] = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    assert fields == {"job": record["job"]}


async def test_enqueue_without_owner_or_token_writes_neither(aredis: aioredis.Redis) -> None:
    job = new_job()
    assert await enqueue(aredis, job)
    assert set(await aredis.hkeys(keys.job_hash(job.id))) == {"job", "status"}


async def test_a_job_enqueued_again_is_not_written_again(aredis: aioredis.Redis) -> None:
    """A retry after a lost reply, or a batch step run again after a crash, queues nothing."""
    job = new_job()
    assert await enqueue(aredis, job)
    await aredis.hset(keys.job_hash(job.id), "status", "running")  # a worker took it
    assert not await enqueue(aredis, job)
    assert await aredis.hget(keys.job_hash(job.id), "status") == "running"
    assert await aredis.xlen(keys.lane_stream("random_tiny", "interactive")) == 1
    assert await aredis.xlen(keys.job_events(job.id)) == 1


async def test_an_events_stream_without_its_record_fails_before_writing_anything(
        aredis: aioredis.Redis) -> None:
    job = new_job()
    await aredis.xadd(keys.job_events(job.id), {"e": "{}"}, id="5-0")
    with pytest.raises(ResponseError):
        await enqueue(aredis, job)
    assert not await aredis.exists(keys.job_hash(job.id), keys.lane_stream("random_tiny", "interactive"))


async def test_enqueue_loads_its_script_into_a_fresh_redis(aredis: aioredis.Redis) -> None:
    await aredis.script_flush()
    assert await enqueue(aredis, new_job())
    await aredis.script_flush()
    batched = Batched(aredis)  # NOSCRIPT inside a pipeline: each caller loads and retries
    jobs = [new_job(f"p{i}") for i in range(20)]
    assert all(await asyncio.gather(*(enqueue(batched, j) for j in jobs)))  # type: ignore[arg-type]
    assert await aredis.xlen(keys.lane_stream("random_tiny", "interactive")) == 21


async def test_batched_commands_share_pipelines_and_each_gets_its_own_answer(
        aredis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    await aredis.set("k:text", "v")
    await aredis.xadd("k:stream", {"f": "v"})
    batched = Batched(aredis)
    pipelines: list[int] = []
    real_pipeline = aredis.pipeline

    def counting_pipeline(*args: object, **kwargs: object) -> object:
        pipe = real_pipeline(*args, **kwargs)  # type: ignore[arg-type]
        real_execute = pipe.execute

        async def execute(**options: object) -> list[object]:
            pipelines.append(len(pipe.command_stack))
            return await real_execute(**options)  # type: ignore[arg-type]

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(aredis, "pipeline", counting_pipeline)

    async def wrong_type() -> str:
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await batched.get("k:stream")
        return "refused"

    answers = await asyncio.gather(
        *(batched.set(f"k:{i}", i, nx=True, ex=60) for i in range(30)),
        batched.get("k:text"), batched.get("k:missing"), wrong_type(),
        batched.hget("k:none", "f"), batched.set("k:text", "w", nx=True))
    assert answers == [True] * 30 + ["v", None, "refused", None, None]
    assert pipelines == [35]  # all made before the sender ran: one round trip
    assert await aredis.get("k:29") == "29"
    assert await batched.ttl("k:0") > 0  # anything else goes straight to the client


async def test_batched_gives_every_caller_a_redis_failure(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    batched = Batched(client)
    failing = client.pipeline

    def broken_pipeline(*args: object, **kwargs: object) -> object:
        pipe = failing(*args, **kwargs)  # type: ignore[arg-type]

        async def execute(**options: object) -> list[object]:
            raise RedisConnectionError("connection lost")

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    client.pipeline = broken_pipeline  # type: ignore[method-assign]
    try:
        assert await batched.set("k:first", 1)  # alone: straight to the client, which works
        results = await asyncio.gather(*(batched.get(f"k:{i}") for i in range(10)),
                                       return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results)  # one pipeline
        assert await batched.get("k:first") == "1"  # and the next command goes on
        await batched.close()
    finally:
        await client.aclose()


async def test_a_cancelled_caller_leaves_the_others_their_answers(
        aredis: aioredis.Redis) -> None:
    batched = Batched(aredis)
    first = asyncio.create_task(batched.set("k:a", 1))
    others = [asyncio.create_task(batched.set(f"k:{i}", i)) for i in range(5)]
    await asyncio.sleep(0)
    others[0].cancel()
    assert await first and await asyncio.gather(*others[1:]) == [True] * 4
    with pytest.raises(asyncio.CancelledError):
        await others[0]


@pytest.fixture
async def started_api(redis_server: RedisServer, redis_url: str,
                      admission: Admission) -> AsyncIterator[SubmitPath]:
    api = SubmitPath(Settings(redis_url=redis_url, model=MODEL), admission=admission)
    await api.start()
    yield api
    await api.stop()


async def test_short_prompts_are_admitted_inline_long_ones_in_a_thread(
        started_api: SubmitPath, monkeypatch: pytest.MonkeyPatch) -> None:
    import anyio.to_thread

    threaded: list[object] = []
    real = anyio.to_thread.run_sync

    async def run_sync(func, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        threaded.append(args[0])
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", run_sync)
    short = JobRequest(prompt="x" * 1000)
    chat = JobRequest(messages=[ChatMessage(role="user", content="hi")] * 3)
    long = JobRequest(prompt="x" * (INLINE_PROMPT_CHARS + 1))  # over random:tiny's context
    many = JobRequest(messages=[ChatMessage(role="user", content="hi")] * 17)
    for request in (short, chat, many):
        await started_api.submit_job(request, tenant="t")
    with pytest.raises(Refusal) as refused:
        await started_api.submit_job(long, tenant="t")
    assert refused.value.status == 422  # the same refusal as ever, from the thread
    assert threaded == [many, long]


def test_is_quick_counts_message_contents() -> None:
    assert Admission.is_quick(JobRequest(prompt="x" * INLINE_PROMPT_CHARS))
    assert not Admission.is_quick(JobRequest(prompt="x" * (INLINE_PROMPT_CHARS + 1)))
    content = "y" * (INLINE_PROMPT_CHARS // 2)
    assert Admission.is_quick(JobRequest(messages=[ChatMessage(role="user", content=content)] * 2))
    assert not Admission.is_quick(JobRequest(
        messages=[ChatMessage(role="user", content=content + "y")] * 2))


async def test_concurrent_submits_make_one_job_each(
        redis_server: RedisServer, redis_url: str, admission: Admission,
        aredis: aioredis.Redis) -> None:
    from tidegate.producer.api import create_app

    settings = Settings(redis_url=redis_url, model=MODEL)
    with serve(create_app(settings, admission=admission)) as url:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=url, timeout=20, limits=limits) as http:
            answers = await asyncio.gather(*(
                http.post("/v1/jobs", json={"prompt": f"p{i}"},
                          headers={"Idempotency-Key": f"key-{i % 100}"})
                for i in range(200)))
    assert sorted(r.status_code for r in answers) == [200] * 100 + [202] * 100
    by_key: dict[str, set[str]] = {}
    for i, r in enumerate(answers):
        by_key.setdefault(f"key-{i % 100}", set()).add(r.json()["id"])
    assert all(len(ids) == 1 for ids in by_key.values())  # twins got the same job
    entries = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    queued = {Job.model_validate_json(fields["job"]).id for _, fields in entries}
    assert len(entries) == 100 and queued == set().union(*by_key.values())
    for job_id in list(queued)[:10]:
        [(entry_id, _)] = await aredis.xrange(keys.job_events(job_id))
        assert entry_id == "1-0"


async def test_stop_waits_for_commands_on_their_way(started_api: SubmitPath) -> None:
    job_ids = [started_api.submit_job(JobRequest(prompt=f"p{i}"), tenant="t")
               for i in range(20)]
    jobs = await asyncio.gather(*job_ids)
    await started_api.stop()
    assert len({j.id for j in jobs}) == 20
    with pytest.raises(RuntimeError):
        await started_api.submit_job(JobRequest(prompt="late"), tenant="t")
    await started_api.start()  # the fixture stops it again


def test_api_access_log_is_off_unless_asked_for() -> None:
    parser = build_parser()
    assert parser.parse_args(["api"]).access_log is False
    assert parser.parse_args(["api", "--access-log"]).access_log is True



def test_a_claim_is_stored_as_it_always_was() -> None:
    """Claims written before this change must still read back, and twins compare values."""
    from dataclasses import asdict

    from tidegate.producer.submit.idempotency import Claim

    claim = Claim(job_id="j" * 32, stream_token="t-_" * 10, created_ms=1796126161822)
    assert claim.encode() == json.dumps(asdict(claim), sort_keys=True)
    assert Claim(**json.loads(claim.encode())) == claim
