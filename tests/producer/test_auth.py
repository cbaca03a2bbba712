"""Auth over real HTTP and WebSockets: every route refuses a missing or unknown key (401/4401)
and another tenant's key (403/4403), serves the owner (and, on the stream, the job's stream
token), keeps keys out of the logs, and steps aside entirely while no key is configured."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import RedisServer
from tests.producer.conftest import serve_stack
from tidegate import keys
from tidegate.http.auth import Auth, Unauthorized, tenant_of, token_hash
from tidegate.producer import Client
from tidegate.producer.errors import Forbidden
from tidegate.producer.errors import Unauthorized as UnauthorizedError
from tidegate.producer.submit.admission import Admission
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(30)

KEY_A = "tg-alpha-3f9c1e7a5b2d4f6081a9c3e5"  # the owner of the jobs below
KEY_B = "tg-bravo-8d2b6f0a4c1e3b5d7f9a0c2e"  # another tenant
WRONG = "tg-nobody-0000000000000000000000"  # configured nowhere


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


CREDENTIALS = {"none": {}, "unknown key": bearer(WRONG), "other tenant": bearer(KEY_B),
               "owner": bearer(KEY_A)}


@pytest.fixture(scope="module")
def secured_server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    with serve_stack(redis_server, admission, api_keys=[KEY_A, KEY_B]) as url:
        yield url


@pytest.fixture
def secured(secured_server: str, redis_url: str) -> str:
    """API + gateway with keys A and B configured, over a freshly flushed Redis."""
    return secured_server


@pytest.fixture
async def http(secured: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=secured, timeout=10) as client:
        yield client


async def submit(http: httpx.AsyncClient, key: str | None = KEY_A) -> dict:
    response = await http.post("/v1/jobs", json={"prompt": "hi"},
                               headers=bearer(key) if key else {})
    assert response.status_code == 202, response.text
    return response.json()


@pytest.fixture
async def job(http: httpx.AsyncClient) -> dict:
    """A queued job of tenant A: its submit answer (id, stream_url, stream_token)."""
    return await submit(http)


async def watch(url: str, headers: dict[str, str], *,
                then: Callable[[], Awaitable[object]] | None = None,
                ) -> tuple[list[dict], int | None]:
    """Every event until the gateway closes, and its close code; ``then`` runs after the
    first event (e.g. a cancel, so that the stream ends)."""
    events: list[dict] = []
    async with ws_connect(url, additional_headers=headers) as ws:
        try:
            async with asyncio.timeout(10):
                async for raw in ws:
                    events.append(json.loads(raw))
                    if len(events) == 1 and then is not None:
                        await then()
        except ConnectionClosed:
            pass
    return events, ws.close_code


def assert_refused(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == {401: "unauthorized", 403: "forbidden"}[status]
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


# ---------------------------------------------------------------- HTTP routes

HTTP_ROUTES = {  # route -> (method, path, status per credential)
    "submit": ("POST", "/v1/jobs", {"none": 401, "unknown key": 401, "other tenant": 202,
                                    "owner": 202}),
    "get": ("GET", "/v1/jobs/{id}", {"none": 401, "unknown key": 401, "other tenant": 403,
                                     "owner": 200}),
    "cancel": ("POST", "/v1/jobs/{id}/cancel", {"none": 401, "unknown key": 401,
                                                "other tenant": 403, "owner": 202}),
}


@pytest.mark.parametrize("who", CREDENTIALS)
@pytest.mark.parametrize("route", HTTP_ROUTES)
async def test_every_route_answers_by_who_is_calling(
        http: httpx.AsyncClient, job: dict, route: str, who: str) -> None:
    method, path, expected = HTTP_ROUTES[route]
    body = {"prompt": "hi"} if route == "submit" else None
    response = await http.request(method, path.format(id=job["id"]), json=body,
                                  headers=CREDENTIALS[who])
    if expected[who] in (401, 403):
        assert_refused(response, expected[who])
    else:
        assert response.status_code == expected[who], response.text


@pytest.mark.parametrize("authorization", [
    KEY_A, f"Basic {KEY_A}", "Bearer", "Bearer  x", f"Bearer {KEY_A}x", f"Bearer {KEY_A[:-1]}"])
async def test_a_malformed_or_near_miss_authorization_is_401(
        http: httpx.AsyncClient, aredis: aioredis.Redis, authorization: str) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "hi"},
                               headers={"Authorization": authorization})
    assert_refused(response, 401)
    assert await aredis.dbsize() == 0


async def test_the_bearer_scheme_is_case_insensitive(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/jobs", json={"prompt": "hi"},
                               headers={"Authorization": f"bearer {KEY_A}"})
    assert response.status_code == 202, response.text


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/jobs/{id}"),
                                              ("POST", "/v1/jobs/{id}/cancel")])
async def test_an_unknown_job_is_404_for_a_known_key_and_401_without_one(
        http: httpx.AsyncClient, method: str, path: str) -> None:
    url = path.format(id="0123456789abcdef")
    assert (await http.request(method, url, headers=bearer(KEY_B))).status_code == 404
    assert_refused(await http.request(method, url), 401)


async def test_healthz_needs_no_key(http: httpx.AsyncClient) -> None:
    response = await http.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_the_job_records_its_tenant_and_token_hash_never_the_secrets(
        job: dict, aredis: aioredis.Redis) -> None:
    record = await aredis.hgetall(keys.job_hash(job["id"]))
    assert record["owner"] == tenant_of(KEY_A) and len(record["owner"]) == 16
    assert record["stream_token_hash"] == token_hash(job["stream_token"])
    stored = json.dumps(record)
    assert KEY_A not in stored and job["stream_token"] not in stored


# ---------------------------------------------------------------- the WebSocket stream


def stream_url(secured: str, job_id: str, query: str = "") -> str:
    return secured.replace("http://", "ws://") + f"/v1/jobs/{job_id}/stream{query}"


@pytest.mark.parametrize(("headers", "with_token", "code"), [
    ({}, False, 4401),
    (bearer(WRONG), False, 4401),
    (bearer(KEY_B), False, 4403),
    ({}, "not-the-token", 4403),
])
async def test_the_stream_refuses_who_may_not_watch(
        secured: str, job: dict, headers: dict, with_token: str | bool, code: int) -> None:
    query = f"?token={with_token}" if with_token else ""
    events, close_code = await watch(stream_url(secured, job["id"], query), headers)
    assert (events, close_code) == ([], code)


@pytest.mark.parametrize(("headers", "use_token"), [
    (bearer(KEY_A), False),  # the owner's key
    ({}, True),  # the job's stream token, as a browser would
    (bearer(KEY_B), True),  # the token is enough whoever presents it
])
async def test_the_owner_or_the_token_holder_gets_the_whole_stream(
        secured: str, http: httpx.AsyncClient, job: dict, headers: dict, use_token: bool) -> None:
    query = f"?token={job['stream_token']}" if use_token else ""
    def cancel() -> Awaitable[httpx.Response]:
        return http.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(KEY_A))

    events, code = await watch(stream_url(secured, job["id"], query), headers, then=cancel)
    assert [e["type"] for e in events] == ["queued", "done"] and code == 1000
    assert events[-1]["finish_reason"] == "cancelled"


async def test_another_jobs_token_is_4403(
        secured: str, http: httpx.AsyncClient, job: dict) -> None:
    other = await submit(http, KEY_A)
    events, code = await watch(stream_url(secured, job["id"], f"?token={other['stream_token']}"),
                               {})
    assert (events, code) == ([], 4403)


@pytest.mark.parametrize(("headers", "query", "code"), [
    (bearer(KEY_A), "", 4404), ({}, "?token=anything", 4404), ({}, "", 4401)])
async def test_an_unknown_job_is_4404_only_to_a_caller_with_credentials(
        secured: str, headers: dict, query: str, code: int) -> None:
    assert await watch(stream_url(secured, "0123456789abcdef", query), headers) == ([], code)


async def test_the_client_streams_with_its_token_or_its_key(secured: str) -> None:
    async with Client(secured, api_key=KEY_A) as client:
        handle = await client.submit("hi")
        assert handle.stream_token is not None
        assert await handle.cancel() == "cancelled"
        by_token = [e.type async for e in handle.events()]
        by_key = [e.type async for e in client.handle(handle.id).events()]  # no token known
    assert by_token == by_key == ["queued", "done"]


async def test_the_client_raises_typed_errors_for_refused_calls(
        secured: str, http: httpx.AsyncClient, job: dict) -> None:
    async with Client(secured) as anonymous, Client(secured, api_key=KEY_B) as other:
        with pytest.raises(UnauthorizedError):
            await anonymous.submit("hi")
        with pytest.raises(Forbidden):
            await other.get(job["id"])
        with pytest.raises(Forbidden):
            await other.cancel(job["id"])
        with pytest.raises(Forbidden):
            async for _ in other.handle(job["id"]).events():
                pass
        with pytest.raises(UnauthorizedError):
            async for _ in anonymous.handle(job["id"]).events():
                pass


# ---------------------------------------------------------------- logs


async def test_keys_and_tokens_never_reach_the_logs(
        secured: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with Client(secured, api_key=KEY_A) as client, httpx.AsyncClient(base_url=secured) as http:
        handle = await client.submit("a full cycle")
        await client.get(handle.id)
        await handle.cancel()
        assert [e.type async for e in handle.events()] == ["queued", "done"]  # by token
        assert [e.type async for e in client.handle(handle.id).events()][-1] == "done"  # by key
        for key in (WRONG, KEY_B):
            await http.get(f"/v1/jobs/{handle.id}", headers=bearer(key))
            await http.post(f"/v1/jobs/{handle.id}/cancel", headers=bearer(key))
            await watch(stream_url(secured, handle.id), bearer(key))
        await watch(stream_url(secured, handle.id, "?token=a-wrong-token-1234"), {})
    secrets = [KEY_A, KEY_B, WRONG, str(handle.stream_token), "a-wrong-token-1234"]
    for record in caplog.records:
        text = f"{record.getMessage()} {record.args!r} {record.exc_text or ''}"
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{record.name}: {text}"
    server = [r.getMessage() for r in caplog.records if r.name == "uvicorn.error"]
    assert any('"WebSocket /v1/jobs/' in m for m in server)  # the server's log was captured
    # uvicorn logs WebSocket handshake headers at DEBUG: there, redacted
    assert any(m.lower() == "< authorization: [redacted]" for m in server)


# ---------------------------------------------------------------- auth off


@pytest.fixture(scope="module")
def open_server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    with serve_stack(redis_server, admission) as url:
        yield url


async def test_with_no_key_configured_nothing_needs_credentials(
        open_server: str, redis_url: str, aredis: aioredis.Redis) -> None:
    async with httpx.AsyncClient(base_url=open_server) as http:
        job = await submit(http, None)
        assert (await http.get(f"/v1/jobs/{job['id']}")).status_code == 200
        assert (await http.get(f"/v1/jobs/{job['id']}", headers=bearer(WRONG))).status_code == 200
        assert await aredis.hget(keys.job_hash(job["id"]), "owner") == "anonymous"
        events, code = await watch(stream_url(open_server, job["id"]), {},
                                   then=lambda: http.post(f"/v1/jobs/{job['id']}/cancel"))
    assert ([e["type"] for e in events], code) == (["queued", "done"], 1000)


async def test_with_auth_off_the_token_works_and_a_wrong_one_is_4403(
        open_server: str, redis_url: str) -> None:
    async with Client(open_server) as client:
        handle = await client.submit("hi")
        await handle.cancel()
        assert [e.type async for e in handle.events()] == ["queued", "done"]
    url = stream_url(open_server, handle.id, "?token=not-it")
    assert await watch(url, {}) == ([], 4403)


@pytest.mark.parametrize(("api_keys", "warnings"), [([], 1), ([KEY_A], 0)])
def test_auth_off_is_announced_once_at_start_up(
        redis_server: RedisServer, admission: Admission, caplog: pytest.LogCaptureFixture,
        api_keys: list[str], warnings: int) -> None:
    caplog.set_level(logging.WARNING, logger="tidegate.http.auth")
    with serve_stack(redis_server, admission, api_keys=api_keys):  # API and gateway both start
        pass
    said = [r for r in caplog.records if r.name == "tidegate.http.auth" and "auth is OFF" in r.getMessage()]
    assert len(said) == warnings


# ---------------------------------------------------------------- configuration


def test_keys_come_from_a_comma_list_a_json_list_and_a_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# the ops team\nk3\n\n   k4  \n  # k5 is retired\n")
    monkeypatch.setenv("TIDEGATE_API_KEYS", " k1, k2 ,")
    monkeypatch.setenv("TIDEGATE_API_KEYS_FILE", str(key_file))
    settings = Settings()
    assert settings.api_keys == ["k1", "k2"]
    auth = Auth.from_settings(settings)
    assert [auth.tenant(f"Bearer {k}") for k in ("k1", "k2", "k3", "k4")] == [
        tenant_of(k) for k in ("k1", "k2", "k3", "k4")]
    for not_a_key in ("k5", "# the ops team", "k1, k2"):
        with pytest.raises(Unauthorized):
            auth.tenant(f"Bearer {not_a_key}")
    monkeypatch.setenv("TIDEGATE_API_KEYS", '["a,b", "c"]')
    assert Settings().api_keys == ["a,b", "c"]


def test_tenants_are_distinct_and_do_not_reveal_the_key() -> None:
    assert tenant_of(KEY_A) != tenant_of(KEY_B)
    assert len(tenant_of(KEY_A)) == 16 and tenant_of(KEY_A) not in KEY_A
