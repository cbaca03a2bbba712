"""What one job may store, bounded from the API: ``max_output_tokens`` refused beyond (422 naming
``max_tokens``) and the default capped to it; a job cancelled while queued keeps its keys for
``cancelled_ttl_s`` only; an Idempotency-Key's claim lives ``idempotency_ttl_s``. Real HTTP
against the shared redis-server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.producer.conftest import MODEL
from tidegate import keys
from tidegate.http.auth import ANONYMOUS
from tidegate.producer.api import create_app
from tidegate.producer.submit.idempotency import Claim
from tidegate.protocol import Job
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(30)

MAX_OUTPUT = 40
CANCELLED_TTL_S = 777
IDEMPOTENCY_TTL_S = 555


@pytest.fixture(scope="module")
def bounded_server(redis_server: RedisServer) -> Iterator[str]:
    # No admission given: the API loads its own, with the settings' bound.
    settings = Settings(redis_url=redis_server.url, model=MODEL, max_output_tokens=MAX_OUTPUT,
                        cancelled_ttl_s=CANCELLED_TTL_S, idempotency_ttl_s=IDEMPOTENCY_TTL_S)
    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture
async def http(bounded_server: str, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=bounded_server) as client:
        yield client


async def queued_job(aredis: aioredis.Redis) -> Job:
    [(_, fields)] = await aredis.xrange(keys.lane_stream("random_tiny", "interactive"))
    return Job.model_validate_json(fields["job"])


async def test_max_tokens_beyond_the_services_bound_is_refused_naming_the_field(
    http: httpx.AsyncClient, aredis: aioredis.Redis,
) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": MAX_OUTPUT + 1})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["fields"][0]["field"] == "max_tokens"
    assert str(MAX_OUTPUT) in error["fields"][0]["reason"]
    assert await aredis.xlen(keys.lane_stream("random_tiny", "interactive")) == 0  # nothing stored
    response = await http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": MAX_OUTPUT})
    assert response.status_code == 202, response.text
    assert (await queued_job(aredis)).sampling.max_tokens == MAX_OUTPUT


async def test_an_unset_max_tokens_gets_the_services_bound(
    http: httpx.AsyncClient, aredis: aioredis.Redis,
) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "hi"})  # the default, 256, is above
    assert response.status_code == 202, response.text
    assert (await queued_job(aredis)).sampling.max_tokens == MAX_OUTPUT


async def test_a_job_cancelled_while_queued_keeps_its_keys_for_the_cancelled_retention(
    http: httpx.AsyncClient, aredis: aioredis.Redis,
) -> None:
    job_id = (await http.post("/v1/jobs", json={"prompt": "hi"})).json()["id"]
    assert await aredis.ttl(keys.job_hash(job_id)) > CANCELLED_TTL_S  # queued: job_ttl_s
    answer = await http.post(f"/v1/jobs/{job_id}/cancel")
    assert answer.json()["status"] == "cancelled"
    for key in (keys.job_hash(job_id), keys.job_events(job_id)):
        assert CANCELLED_TTL_S - 5 <= await aredis.ttl(key) <= CANCELLED_TTL_S
    assert (await http.get(f"/v1/jobs/{job_id}")).json()["finish_reason"] == "cancelled"


async def test_an_idempotency_claim_lives_the_configured_time(
    http: httpx.AsyncClient, aredis: aioredis.Redis,
) -> None:
    body = {"prompt": "hi", "idempotency_key": "order-7"}
    first = await http.post("/v1/jobs", json=body)
    assert first.status_code == 202, first.text
    name = keys.idempotency(ANONYMOUS, "order-7")  # auth is off: the anonymous tenant
    assert Claim(**json.loads(await aredis.get(name))).job_id == first.json()["id"]
    assert IDEMPOTENCY_TTL_S - 5 <= await aredis.ttl(name) <= IDEMPOTENCY_TTL_S
