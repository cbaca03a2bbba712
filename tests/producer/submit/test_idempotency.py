"""Idempotent submits over real HTTP: a repeated Idempotency-Key returns the same job (200, the
same body), concurrent twins make one job, tenants never share keys, and a key whose job never
appeared is reclaimed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.conftest import RedisServer
from tests.producer.conftest import serve_stack
from tidegate import keys
from tidegate.producer import Client
from tidegate.producer.submit.admission import Admission
from tidegate.producer.submit.idempotency import STALE_CLAIM_MS, Claim
from tidegate.producer.submit.submit_path import SubmitPath
from tidegate.protocol import now_ms
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(30)

KEY_A = "tg-alpha-idem-5e1d9c3b7a"
KEY_B = "tg-bravo-idem-2f8a6c4e0b"


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    with serve_stack(redis_server, admission, api_keys=[KEY_A, KEY_B]) as url:
        yield url


@pytest.fixture
async def http(server: str, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """Tenant A's HTTP client, over a freshly flushed Redis."""
    async with httpx.AsyncClient(base_url=server, timeout=10,
                                 headers={"Authorization": f"Bearer {KEY_A}"}) as client:
        yield client


async def submit(http: httpx.AsyncClient, key: str | None = None, **body: object) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await http.post("/v1/jobs", json={"prompt": "hi", **body}, headers=headers)


async def lane_entries(aredis: aioredis.Redis) -> int:
    return await aredis.xlen(keys.lane_stream("random_tiny", "interactive"))


async def test_a_repeat_returns_the_same_job_with_200(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    first = await submit(http, "order-1001")
    again = await submit(http, "order-1001")
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json() == first.json()  # id, stream_url, status, stream_token
    assert again.headers["location"] == first.headers["location"]
    assert await lane_entries(aredis) == 1


async def test_the_repeat_reports_the_jobs_current_status(http: httpx.AsyncClient) -> None:
    first = (await submit(http, "order-1002")).json()
    assert (await http.post(f"/v1/jobs/{first['id']}/cancel")).status_code == 202
    again = await submit(http, "order-1002")
    assert again.status_code == 200
    assert again.json() == first | {"status": "done"}


async def test_the_body_field_is_the_same_key_as_the_header(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    by_body = await submit(http, idempotency_key="order-1003")
    by_header = await submit(http, "order-1003")
    both = await submit(http, "order-1003", idempotency_key="order-1003")
    assert [r.status_code for r in (by_body, by_header, both)] == [202, 200, 200]
    assert by_body.json() == by_header.json() == both.json()
    assert await lane_entries(aredis) == 1


@pytest.mark.parametrize(("header", "body_key"), [
    ("order-1", "order-2"),  # the two disagree
    ("has space", None),  # printable ASCII without spaces only
    ("k" * 256, None),  # at most 255 characters
    (None, ""),
])
async def test_a_bad_or_conflicting_key_is_422_naming_idempotency_key(
        http: httpx.AsyncClient, aredis: aioredis.Redis,
        header: str | None, body_key: str | None) -> None:
    body = {} if body_key is None else {"idempotency_key": body_key}
    response = await submit(http, header, **body)
    assert response.status_code == 422, response.text
    assert [f["field"] for f in response.json()["error"]["fields"]] == ["idempotency_key"]
    assert await aredis.dbsize() == 0


async def test_concurrent_twins_make_exactly_one_job(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    responses = await asyncio.gather(*(submit(http, "burst-7") for _ in range(10)))
    assert sorted(r.status_code for r in responses) == [200] * 9 + [202]
    assert len({r.json()["id"] for r in responses}) == 1
    assert len({r.json()["stream_token"] for r in responses}) == 1
    assert await lane_entries(aredis) == 1


async def test_tenants_with_the_same_key_get_their_own_jobs(
        server: str, http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    mine = await submit(http, "shared-key")
    async with httpx.AsyncClient(base_url=server,
                                 headers={"Authorization": f"Bearer {KEY_B}"}) as other:
        theirs = await submit(other, "shared-key")
    assert (mine.status_code, theirs.status_code) == (202, 202)
    assert mine.json()["id"] != theirs.json()["id"]
    assert await lane_entries(aredis) == 2


async def test_without_a_key_every_submit_is_a_new_job(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    ids = {(await submit(http)).json()["id"] for _ in range(3)}
    assert len(ids) == 3 and await lane_entries(aredis) == 3


async def test_a_claim_whose_job_never_appeared_is_reclaimed(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    from tidegate.http.auth import tenant_of

    # What an API process that died between claiming the key and enqueueing leaves behind.
    orphan = Claim(job_id="0123456789abcdef", stream_token="t",
                   created_ms=now_ms() - STALE_CLAIM_MS - 1)
    await aredis.set(keys.idempotency(tenant_of(KEY_A), "order-9"), orphan.encode())
    response = await submit(http, "order-9")
    assert response.status_code == 202, response.text
    assert response.json()["id"] != orphan.job_id
    assert (await submit(http, "order-9")).json()["id"] == response.json()["id"]


async def test_the_claim_expires_with_the_idempotency_ttl(
        http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    from tidegate.http.auth import tenant_of

    await submit(http, "order-ttl")
    ttl_s = await aredis.ttl(keys.idempotency(tenant_of(KEY_A), "order-ttl"))
    assert keys.IDEMPOTENCY_TTL_S - 5 <= ttl_s <= keys.IDEMPOTENCY_TTL_S


async def test_the_client_sends_the_key_and_gets_the_same_handle(server: str, redis_url: str) -> None:
    async with Client(server, api_key=KEY_A) as client:
        first = await client.submit("hi", idempotency_key="client-1")
        again = await client.submit("hi", idempotency_key="client-1")
    assert (again.id, again.stream_token) == (first.id, first.stream_token)


async def test_with_auth_off_callers_share_the_anonymous_tenant(
        redis_server: RedisServer, admission: Admission, redis_url: str) -> None:
    with serve_stack(redis_server, admission) as url:
        async with httpx.AsyncClient(base_url=url) as one, httpx.AsyncClient(base_url=url) as two:
            first, again = await submit(one, "anon-1"), await submit(two, "anon-1")
    assert (first.status_code, again.status_code) == (202, 200)
    assert first.json() == again.json()


class _EnqueueFailsOnce(SubmitPath):
    """The submit path with a bug after the claim: its first enqueue raises a non-Redis error."""

    failed = False

    async def _enqueue(self, job, prompt_ids, *, tenant, stream_token=None):  # noqa: ANN001, ANN202
        if not self.failed:
            self.failed = True
            raise ValueError("not a RedisError: e.g. a job that cannot be serialised")
        return await super()._enqueue(job, prompt_ids, tenant=tenant, stream_token=stream_token)


async def test_any_failure_after_the_claim_releases_the_key(
        redis_url: str, admission: Admission, aredis: aioredis.Redis) -> None:
    api = _EnqueueFailsOnce(Settings(redis_url=redis_url, model="random:tiny"),
                            admission=admission)
    await api.start()
    try:
        body = {"prompt": "hi", "idempotency_key": "order-7"}
        with pytest.raises(ValueError, match="not a RedisError"):
            await api.accept("anonymous", body)
        assert await aredis.get(keys.idempotency("anonymous", "order-7")) is None
        claim, status, code = await api.accept("anonymous", body)  # at once, not a 409
        assert (status, code) == ("queued", 202)
    finally:
        await api.stop()
