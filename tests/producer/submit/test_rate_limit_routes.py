"""Rate limits as clients meet them: per-key limits read from a keys file, 429 ``rate_limited``
with ``Retry-After`` and the ``x-ratelimit-*`` headers on ``POST /v1/jobs``, the OpenAI routes
(the official client's ``RateLimitError``) and ``/v1/stream`` (4429), one tenant's buckets
shared by two API replicas on one Redis, other tenants unaffected, and the refusals counted
in ``/metrics``. Real HTTP and WebSockets, real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import RedisServer
from tests.producer.conftest import serve_stack
from tests.producer.openai_compat.test_openai_api import ScriptedWorker
from tidegate import keys
from tidegate.http.auth import tenant_of
from tidegate.producer import Client
from tidegate.producer.errors import QueueFull, RateLimitExceeded
from tidegate.producer.submit.admission import Admission
from tidegate.producer.submit.rate_limit import duration
from tidegate.protocol import JobRequest

pytestmark = pytest.mark.timeout(30)

KEY_SLOW = "tg-slow-3f9c1e7a5b2d4f6081a9c3e5"  # one request per 10 s
KEY_TOKENS = "tg-tokens-8d2b6f0a4c1e3b5d7f9a0c"  # 600 tokens a minute (10 a second)
KEY_FREE = "tg-free-0a4c1e3b5d7f9a0c2e4b6d8f"  # the defaults: unlimited
KEYS_FILE = f"""# limits per key
{KEY_SLOW}   requests_per_s=0.1
{KEY_TOKENS} tokens_per_min=600
{KEY_FREE}
"""
RATE_HEADERS = ("limit", "remaining", "reset")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module")
def replicas(redis_server: RedisServer, admission: Admission,
             keys_file: Path) -> Iterator[tuple[str, str]]:
    """Two API (+ gateway) processes' apps on one Redis, both reading the keys file."""
    with serve_stack(redis_server, admission, api_keys_file=str(keys_file)) as one, \
            serve_stack(redis_server, admission, api_keys_file=str(keys_file)) as two:
        yield one, two


@pytest.fixture
def api(replicas: tuple[str, str], redis_url: str) -> str:
    """The first replica's URL, over a freshly flushed Redis (every bucket full)."""
    return replicas[0]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def submit(http: httpx.AsyncClient, base: str, key: str, **body: object) -> httpx.Response:
    return await http.post(f"{base}/v1/jobs", json={"prompt": "hi", **body}, headers=bearer(key))


def rate_headers(response: httpx.Response | openai.APIStatusError, name: str) -> dict[str, str]:
    headers = response.headers if isinstance(response, httpx.Response) else response.response.headers
    return {part: headers[f"x-ratelimit-{part}-{name}"] for part in RATE_HEADERS
            if f"x-ratelimit-{part}-{name}" in headers}


def prompt_tokens(admission: Admission, prompt: str = "hi") -> int:
    return admission.count_prompt_tokens(JobRequest(prompt=prompt))


# ---------------------------------------------------------------- POST /v1/jobs


async def test_a_key_over_its_request_rate_gets_429_with_retry_after_and_the_headers(
        api: str, http: httpx.AsyncClient, aredis: aioredis.Redis) -> None:
    await aredis.script_flush()  # as on a fresh Redis: the API loads the bucket script itself
    accepted = await submit(http, api, KEY_SLOW)
    assert accepted.status_code == 202, accepted.text
    assert rate_headers(accepted, "requests") == {"limit": "1", "remaining": "0",
                                                  "reset": "10s"}
    assert rate_headers(accepted, "tokens") == {}  # this key has no tokens limit
    refused = await submit(http, api, KEY_SLOW)
    assert refused.status_code == 429
    retry_after_s = int(refused.headers["retry-after"])
    assert 9 <= retry_after_s <= 10
    assert refused.json() == {"error": {
        "type": "rate_limited", "message": "rate limit reached for this API key: 0.1 requests "
        f"per second (1 at once); retry in {retry_after_s} s", "fields": [],
        "limit": "requests", "retry_after_s": retry_after_s}}
    assert rate_headers(refused, "requests")["remaining"] == "0"
    assert re.fullmatch(r"\d+(\.\d+)?s", rate_headers(refused, "requests")["reset"])
    assert await aredis.xlen(keys.lane_stream("random_tiny", "interactive")) == 1  # the refused one: nothing


async def test_tokens_are_charged_prompt_plus_max_tokens_at_submit(
        api: str, http: httpx.AsyncClient, admission: Admission) -> None:
    cost = prompt_tokens(admission) + 250
    for n in (1, 2):
        accepted = await submit(http, api, KEY_TOKENS, max_tokens=250)
        assert accepted.status_code == 202, accepted.text
        headers = rate_headers(accepted, "tokens")
        assert (headers["limit"], headers["remaining"]) == ("600", str(600 - n * cost))
    refused = await submit(http, api, KEY_TOKENS, max_tokens=250)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["limit"]) == ("rate_limited", "tokens")
    assert f"this request needs {cost}" in error["message"]
    # A smaller request still fits in what is left.
    assert (await submit(http, api, KEY_TOKENS, max_tokens=1)).status_code == 202


async def test_other_tenants_are_unaffected(api: str, http: httpx.AsyncClient) -> None:
    assert (await submit(http, api, KEY_SLOW)).status_code == 202
    assert (await submit(http, api, KEY_SLOW)).status_code == 429
    for _ in range(5):
        free = await submit(http, api, KEY_FREE)
        assert free.status_code == 202
        assert not [h for h in free.headers if h.startswith("x-ratelimit")]  # unlimited
    assert (await submit(http, api, KEY_TOKENS)).status_code == 202


async def test_a_repeated_idempotency_key_is_not_charged_again(
        api: str, http: httpx.AsyncClient) -> None:
    first = await submit(http, api, KEY_SLOW, idempotency_key="order-1")
    again = await submit(http, api, KEY_SLOW, idempotency_key="order-1")
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json()["id"] == first.json()["id"]
    assert (await submit(http, api, KEY_SLOW, idempotency_key="order-2")).status_code == 429


async def test_two_api_replicas_share_one_tenants_limits(
        replicas: tuple[str, str], redis_url: str, http: httpx.AsyncClient,
        admission: Admission) -> None:
    one, two = replicas
    assert (await submit(http, one, KEY_SLOW)).status_code == 202
    assert (await submit(http, two, KEY_SLOW)).status_code == 429
    cost = prompt_tokens(admission) + 250
    assert (await submit(http, two, KEY_TOKENS, max_tokens=250)).status_code == 202
    second = await submit(http, one, KEY_TOKENS, max_tokens=250)
    assert rate_headers(second, "tokens")["remaining"] == str(600 - 2 * cost)
    assert (await submit(http, two, KEY_TOKENS, max_tokens=250)).status_code == 429
    assert (await submit(http, one, KEY_TOKENS, max_tokens=250)).status_code == 429


async def test_refusals_are_counted_in_metrics_by_tenant_and_limit(
        api: str, http: httpx.AsyncClient) -> None:
    def count(text: str) -> float:
        line = f'tidegate_rate_limited_total{{limit="requests",tenant="{tenant_of(KEY_SLOW)}"}}'
        found = [row.split()[-1] for row in text.splitlines() if row.startswith(line)]
        return float(found[0]) if found else 0.0

    before = count((await http.get(f"{api}/metrics")).text)
    await submit(http, api, KEY_SLOW)
    for _ in range(3):
        assert (await submit(http, api, KEY_SLOW)).status_code == 429
    metrics = (await http.get(f"{api}/metrics")).text
    assert count(metrics) == before + 3
    assert "# TYPE tidegate_rate_limited_total counter" in metrics
    assert KEY_SLOW not in metrics


async def test_the_python_client_raises_rate_limit_exceeded_naming_the_limit(api: str) -> None:
    async with Client(api, api_key=KEY_SLOW) as client:
        await client.submit("hi")
        with pytest.raises(RateLimitExceeded) as refused:
            await client.submit("hi")
    assert (refused.value.limit, refused.value.status, refused.value.type) == (
        "requests", 429, "rate_limited")
    assert refused.value.retry_after_s is not None and 9 <= refused.value.retry_after_s <= 10
    assert isinstance(refused.value, QueueFull)  # what callers caught for any 429 before


# ---------------------------------------------------------------- OpenAI routes


@pytest.fixture
async def worker(aredis: aioredis.Redis) -> AsyncIterator[ScriptedWorker]:
    fake = ScriptedWorker(aredis)
    task = asyncio.create_task(fake.run())
    yield fake
    for running in [task, *fake.jobs]:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


def openai_client(base: str, key: str, *, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=max_retries,
                              timeout=10)


async def test_the_openai_client_sees_the_headers_then_a_rate_limit_error(
        api: str, worker: ScriptedWorker) -> None:
    async with openai_client(api, KEY_SLOW) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tidegate", messages=[{"role": "user", "content": "one two"}])
        assert raw.parse().choices[0].message.content == "one two "
        assert rate_headers(httpx.Response(200, headers=raw.headers), "requests") == {
            "limit": "1", "remaining": "0", "reset": "10s"}
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(model="tidegate", prompt="three")
    error = refused.value
    assert (error.status_code, error.type, error.code) == (429, "rate_limit_error", "rate_limited")
    assert "0.1 requests per second" in error.message
    assert 9 <= int(error.response.headers["retry-after"]) <= 10
    assert rate_headers(error, "requests")["remaining"] == "0"


async def test_a_streamed_answer_carries_the_headers_too(
        api: str, http: httpx.AsyncClient, worker: ScriptedWorker, admission: Admission) -> None:
    body = {"model": "tidegate", "prompt": "a b c", "max_tokens": 100, "stream": True}
    response = await http.post(f"{api}/v1/completions", json=body, headers=bearer(KEY_TOKENS))
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    cost = prompt_tokens(admission, "a b c") + 100  # back at 10 tokens/s: 100 ms each
    assert rate_headers(response, "tokens") == {
        "limit": "600", "remaining": str(600 - cost), "reset": duration(cost * 100)}


async def test_a_request_over_the_whole_tokens_limit_is_not_retried_by_the_client(
        api: str, http: httpx.AsyncClient) -> None:
    async with openai_client(api, KEY_TOKENS, max_retries=3) as client:
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(model="tidegate", prompt="hi", max_tokens=700)
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.value.response.headers
    assert "lower max_tokens" in refused.value.message
    # The client gave up at once: the bucket is untouched, a full-size request still fits.
    accepted = await submit(http, api, KEY_TOKENS, max_tokens=500)
    assert accepted.status_code == 202, accepted.text


# ---------------------------------------------------------------- /v1/stream


async def test_a_socket_submit_over_the_limit_is_refused_with_4429(
        api: str, http: httpx.AsyncClient) -> None:
    assert (await submit(http, api, KEY_SLOW)).status_code == 202
    frames: list[dict] = []
    async with ws_connect(api.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "generate", "request": {"prompt": "hi"},
                                  "api_key": KEY_SLOW}))
        with contextlib.suppress(ConnectionClosed):
            async with asyncio.timeout(10):
                async for raw in ws:
                    frames.append(json.loads(raw))
    assert ws.close_code == 4429
    [frame] = frames
    assert (frame["type"], frame["status"]) == ("error", 429)
    assert (frame["error"]["type"], frame["error"]["limit"]) == ("rate_limited", "requests")
    assert 9 <= frame["error"]["retry_after_s"] <= 10


# ---------------------------------------------------------------- auth off


async def test_with_auth_off_every_caller_shares_the_anonymous_tenants_default_limits(
        redis_server: RedisServer, admission: Admission, redis_url: str,
        http: httpx.AsyncClient) -> None:
    with serve_stack(redis_server, admission, rate_limit_requests_per_s=0.1,
                     rate_limit_tokens_per_min=100_000) as url:
        first = await http.post(f"{url}/v1/jobs", json={"prompt": "hi"})
        second = await http.post(f"{url}/v1/jobs", json={"prompt": "hi"},
                                 headers={"Authorization": "Bearer anything"})
    assert (first.status_code, second.status_code) == (202, 429)
    assert rate_headers(first, "tokens")["limit"] == "100000"
    assert await redis_keys(redis_url) == [keys.rate_limit("anonymous")]


async def redis_keys(url: str) -> list[str]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return sorted(k for k in await client.keys("tidegate:rate:*"))
    finally:
        await client.aclose()


async def test_without_limits_nothing_changes(
        redis_server: RedisServer, admission: Admission, redis_url: str,
        http: httpx.AsyncClient) -> None:
    with serve_stack(redis_server, admission) as url:
        answers = [await http.post(f"{url}/v1/jobs", json={"prompt": "hi"}) for _ in range(5)]
    assert [a.status_code for a in answers] == [202] * 5
    assert not [h for a in answers for h in a.headers if h.startswith("x-ratelimit")]
    assert await redis_keys(redis_url) == []
