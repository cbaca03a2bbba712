"""The producer API over real HTTP: submit queues a job, GET reads it back, and every bad
request gets a JSON error naming the field, with nothing written to Redis."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.asgi_server import serve
from tests.conftest import free_port
from tests.metric_reference import assert_documented
from tests.producer.conftest import MODEL
from tidegate import keys
from tidegate.http.auth import token_hash
from tidegate.jobstore import set_status
from tidegate.producer.api import create_app
from tidegate.producer.submit.admission import Admission
from tidegate.producer.submit.request_body import MAX_BODY_BYTES
from tidegate.protocol import MAX_TOKENS_LIMIT, Job
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def http(api: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api, timeout=10) as client:
        yield client


async def test_submit_answers_202_and_queues_the_job(
        api: str, http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 8})
    assert response.status_code == 202, response.text
    body = response.json()
    job_id = body["id"]
    token = body["stream_token"]
    assert body == {"id": job_id, "status": "queued", "stream_token": token,
                    "stream_url": api.replace("http://", "ws://") + f"/v1/jobs/{job_id}/stream"}
    assert response.headers["location"] == f"/v1/jobs/{job_id}"
    assert len(token) >= 43  # 32 random bytes, urlsafe base64

    [(_, fields)] = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    job = Job.model_validate_json(fields["job"])
    assert (job.id, job.prompt, job.sampling.max_tokens) == (job_id, "hello", 8)
    record = await aredis.hgetall(keys.job_hash(job_id))
    assert (record["status"], record["owner"]) == ("queued", "anonymous")  # auth is off
    assert record["stream_token_hash"] == token_hash(token) and token not in str(record)
    [(_, event)] = await aredis.xrange(keys.job_events(job_id))
    assert json.loads(event["e"]) == {"id": 1, "job_id": job_id, "type": "queued",
                                      "lane": "interactive"}


@pytest.mark.parametrize("priority", [-100, 0, 7, 100])
async def test_priority_reaches_the_enqueued_job(
        http: httpx.AsyncClient, aredis: aioredis.Redis, priority: int) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "hi", "priority": priority})
    assert response.status_code == 202, response.text
    [(_, fields)] = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    assert Job.model_validate_json(fields["job"]).priority == priority


async def test_unset_max_tokens_is_capped_to_the_room_the_prompt_leaves(
        http: httpx.AsyncClient, aredis: aioredis.Redis, admission: Admission) -> None:
    context = admission.max_context
    prompt = "y" * (context - 100)  # byte-level model: about one token per character
    response = await http.post("/v1/jobs", json={"prompt": prompt})
    assert response.status_code == 202, response.text
    [(_, fields)] = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    job = Job.model_validate_json(fields["job"])
    room = context - len(admission.tokenizer.encode_prompt(prompt, None))
    assert 0 < room < 256 and job.sampling.max_tokens == room


async def test_submit_chat_messages_to_the_batch_lane(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "lane": "batch"}
    response = await http.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    assert await aredis.xlen(keys.lane_stream("random_tiny", "batch")) == 1
    assert await aredis.xlen(keys.lane_stream("random_tiny", "interactive")) == 0


async def test_get_reads_the_status_then_the_finished_result(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    job_id = (await http.post("/v1/jobs", json={"prompt": "hi"})).json()["id"]
    queued = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert (queued["id"], queued["status"], queued["lane"], queued["text"]) == (
        job_id, "queued", "interactive", None)

    result = {"text": "Hello", "finish_reason": "stop",
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
              "timings": {"queue_ms": 1.0, "ttft_ms": 2.0, "total_ms": 3.0,
                          "decode_tokens_per_s": 4.0}}
    pipe = aredis.pipeline(transaction=True)
    set_status(pipe, job_id, "done", result=json.dumps(result))
    await pipe.execute()
    response = await http.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200
    assert response.json() | result == response.json()
    assert response.json()["status"] == "done"


@pytest.mark.parametrize("job_id", ["0123456789abcdef0123456789abcdef", "not.a.job", "x" * 65])
async def test_get_unknown_or_invalid_job_is_404(http: httpx.AsyncClient, job_id: str) -> None:
    response = await http.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"


LONG = "x" * 3000  # over random:tiny's 2048-token context (one token per byte)
MSG = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("content", "status", "kind", "field"),
    [
        (b'{"prompt": ', 400, "invalid_json", "body"),
        (b'\xff\xfe{"prompt": "x"}', 400, "invalid_json", "body"),
        (b"[1, 2]", 422, "invalid_request", "body"),
        ({"prompt": "x", "colour": "blue"}, 422, "invalid_request", "colour"),
        ({"prompt": "x", "max_tokens": -1}, 422, "invalid_request", "max_tokens"),
        ({"prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}, 422, "invalid_request", "max_tokens"),
        ({"prompt": "x", "max_tokens": 2048}, 422, "context_length_exceeded", "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, 422, "invalid_request", "temperature"),
        ({"prompt": ""}, 422, "invalid_request", "prompt"),
        ({"prompt": "   "}, 422, "invalid_request", "prompt"),
        ({}, 422, "invalid_request", "prompt"),
        ({"prompt": "x", "messages": [MSG]}, 422, "invalid_request", "prompt"),
        ({"messages": []}, 422, "invalid_request", "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 422, "invalid_request",
         "messages.0.role"),
        ({"prompt": "x", "lane": "vip"}, 422, "invalid_request", "lane"),
        ({"prompt": "x", "priority": 101}, 422, "invalid_request", "priority"),
        ({"prompt": "x", "priority": -101}, 422, "invalid_request", "priority"),
        ({"prompt": "x", "priority": 1.5}, 422, "invalid_request", "priority"),
        ({"prompt": "x", "timeout_s": 1, "deadline_ms": 5}, 422, "invalid_request", "deadline_ms"),
        ({"prompt": LONG}, 422, "context_length_exceeded", "prompt"),
        ({"messages": [{"role": "user", "content": LONG}]}, 422, "context_length_exceeded",
         "messages"),
    ],
)
async def test_bad_requests_name_the_field_and_write_nothing(
        http: httpx.AsyncClient, aredis: aioredis.Redis,
        content: bytes | dict, status: int, kind: str, field: str) -> None:
    payload = {"content": content} if isinstance(content, bytes) else {"json": content}
    response = await http.post("/v1/jobs", **payload)  # type: ignore[arg-type]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind
    assert field in [f["field"] for f in error["fields"]], error
    assert all(f["reason"] for f in error["fields"]) and error["message"]
    assert await aredis.dbsize() == 0


async def test_every_field_error_is_reported_at_once(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "x", "top_p": 0, "lane": "vip"})
    assert {f["field"] for f in response.json()["error"]["fields"]} == {"top_p", "lane"}


async def test_a_body_over_the_limit_is_413(http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    response = await http.post("/v1/jobs", content=b" " * (MAX_BODY_BYTES + 1))
    assert (response.status_code, response.json()["error"]["type"]) == (413, "request_too_large")
    assert await aredis.dbsize() == 0


async def test_routing_errors_are_json(http: httpx.AsyncClient) -> None:
    missing = await http.get("/v2/nothing")
    wrong_method = await http.delete("/v1/jobs")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "not_found")
    assert (wrong_method.status_code, wrong_method.json()["error"]["type"]) == (
        405, "method_not_allowed")


async def test_healthz(http: httpx.AsyncClient) -> None:
    response = await http.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_redis_unreachable_is_503(admission: Admission) -> None:
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", model=MODEL)
    with serve(create_app(settings, admission=admission)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            submitted = await http.post("/v1/jobs", json={"prompt": "hi"})
            read = await http.get("/v1/jobs/abc")
    for response in (submitted, read):
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"


async def test_stream_url_uses_the_configured_gateway(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, model=MODEL, gateway_url="wss://gw.example/")
    with serve(create_app(settings)) as url:  # start() loads the model's tokenizer itself
        async with httpx.AsyncClient(base_url=url) as http:
            body = (await http.post("/v1/jobs", json={"prompt": "hi"})).json()
    assert body["stream_url"] == f"wss://gw.example/v1/jobs/{body['id']}/stream"


async def test_readiness_and_queue_metrics(http: httpx.AsyncClient) -> None:
    assert (await http.get("/readyz")).json() == {"ready": True, "reason": "ready"}
    assert (await http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 3})).status_code == 202
    r = await http.get("/metrics")
    assert r.status_code == 200 and "text/plain" in r.headers["content-type"]
    lag = [line for line in r.text.splitlines()
           if line.startswith('tidegate_queue_lag{lane="interactive",model="random_tiny",'
                              'partition="0"}')]
    assert lag and float(lag[0].split()[-1]) >= 1
    assert "tidegate_redis_up 1.0" in r.text
    assert_documented(r.text)
