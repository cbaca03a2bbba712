"""Hostile input over real HTTP and WebSocket (API + gateway on one port, real redis-server):
nesting past any parser's stack, Unicode digits where a number goes, lone surrogates in text.
Each gets a 400 (or close 4400) naming the field, never a 500, a 1006 or a stuck
Idempotency-Key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.asgi_server import server_errors
from tests.producer.conftest import MODEL
from tidegate.benchmarks.serving.fuzzing.socket_cases import json_values, request_bodies
from tidegate.producer.api import create_app
from tidegate.producer.submit.admission import Admission
from tidegate.settings import Settings

pytestmark = pytest.mark.timeout(30)

DEEP = ("[" * 100_000 + "]" * 100_000).encode()
GENERATION_ROUTES = ["/v1/jobs", "/v1/chat/completions", "/v1/completions"]


def error_fields(response: httpx.Response) -> list[str]:
    """The fields an error names, in tidegate's shape or OpenAI's (``param``)."""
    error = response.json()["error"]
    if "fields" in error:
        return [f["field"] for f in error["fields"]]
    return [error["param"]]


async def frames_until_close(ws) -> tuple[list[dict], int | None, str]:  # noqa: ANN001
    frames = []
    try:
        async with asyncio.timeout(10):
            async for raw in ws:
                frames.append(json.loads(raw))
    except ConnectionClosed:
        pass
    return frames, ws.close_code, ws.close_reason or ""


async def submitted(stack: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{stack}/v1/jobs", json={"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 202, response.text
    return response.json()


@pytest.mark.parametrize("route", GENERATION_ROUTES)
@pytest.mark.parametrize("body", [DEEP, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                  b'{"model": "tidegate", "prompt": ' + b"[" * 70 + b"]" * 70 + b"}"])
async def test_deeply_nested_json_is_a_400_naming_the_body(
        stack: str, route: str, body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{stack}{route}", content=body,
                                   headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "nested deeper than 64 levels" in response.text
    assert error_fields(response)[0] in ("body", "prompt") or "prompt." in error_fields(response)[0]
    assert server_errors(caplog.records) == []


@pytest.mark.parametrize("route, body", [
    ("/v1/jobs", {"prompt": "hi", "stop": ["\ud800"]}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "a\udfffb"}]}),
    ("/v1/chat/completions", {"model": "tidegate", "stop": "\ud800",
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "tidegate", "prompt": "x\ud800"}),
])
async def test_a_lone_surrogate_is_a_400_naming_its_field(
        stack: str, route: str, body: dict, caplog: pytest.LogCaptureFixture) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \ud800 escape
    assert b"\\ud" in raw
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{stack}{route}", content=raw,
                                   headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    [field, *_] = error_fields(response)
    assert field in ("stop", "stop.0", "messages.0.content", "prompt"), response.text
    assert "lone surrogate" in response.text
    assert server_errors(caplog.records) == []


async def test_a_lone_surrogate_as_raw_bytes_is_refused_too(stack: str) -> None:
    raw = b'{"prompt": "hi", "stop": ["\xed\xa0\x80"]}'  # what json.loads lets through
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{stack}/v1/jobs", content=raw)
    assert response.status_code == 400 and error_fields(response) == ["stop.0"], response.text


async def test_a_refused_submit_leaves_its_idempotency_key_free(
        stack: str, aredis: aioredis.Redis) -> None:
    headers = {"Idempotency-Key": "order-surrogate-1", "content-type": "application/json"}
    bad = json.dumps({"prompt": "hi", "stop": ["\ud800"]})
    async with httpx.AsyncClient(timeout=10) as http:
        first = await http.post(f"{stack}/v1/jobs", content=bad, headers=headers)
        retry = await http.post(f"{stack}/v1/jobs", json={"prompt": "hi", "stop": ["x"]},
                                headers=headers)
    assert first.status_code == 400, first.text
    assert retry.status_code == 202, retry.text


@pytest.mark.parametrize("value", ["²", "١٢", "1e3", "-1", "9" * 19, "+1", "0x1"])
async def test_a_bad_last_event_id_is_a_400_on_sse_and_4400_on_the_socket(
        stack: str, value: str, caplog: pytest.LogCaptureFixture) -> None:
    job = await submitted(stack)
    params = {"token": job["stream_token"], "last_event_id": value}
    async with httpx.AsyncClient(timeout=10) as http:
        sse = await http.get(f"{stack}/v1/jobs/{job['id']}/events", params=params)
        header = await http.get(f"{stack}/v1/jobs/{job['id']}/events",
                                params={"token": job["stream_token"]},
                                headers={"Last-Event-ID": value.encode()})
    for response in (sse, header):
        assert response.status_code == 400, response.text
        assert error_fields(response) == ["last_event_id"]
    query = str(httpx.QueryParams(params))
    async with ws_connect(f"{job['stream_url']}?{query}") as ws:
        _, code, reason = await frames_until_close(ws)
    assert code == 4400 and "last_event_id" in reason
    assert server_errors(caplog.records) == []


async def test_a_latin_1_digit_in_last_event_id_header_is_a_400(stack: str) -> None:
    job = await submitted(stack)  # b"\xb2" is "²" to a server that reads headers as latin-1
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{stack}/v1/jobs/{job['id']}/events",
                                  params={"token": job["stream_token"]},
                                  headers={"Last-Event-ID": b"\xb2"})
    assert response.status_code == 400 and error_fields(response) == ["last_event_id"]


@pytest.mark.parametrize("last_event_id", [10**18, 10**40, -1, "3", 1.5, True])
async def test_a_bad_resume_point_on_v1_stream_is_4400(stack: str, last_event_id: object) -> None:
    job = await submitted(stack)
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "resume", "job_id": job["id"],
                                  "token": job["stream_token"], "last_event_id": last_event_id}))
        frames, code, _ = await frames_until_close(ws)
    assert code == 4400
    assert frames[0]["error"]["fields"][0]["field"] == "last_event_id"


@pytest.mark.parametrize("frame, field", [
    ("[" * 100_000 + "]" * 100_000, "frame"),
    ('{"type": "generate", "request": ' + "[" * 3000 + "]" * 3000 + "}", "frame"),
    (json.dumps({"type": "generate", "request": {"prompt": "hi", "stop": ["\ud800"]}}),
     "request.stop.0"),
    ('{"type": "generate", "request": {"prompt": "hi", "max_tokens": NaN}}', "frame"),
])
async def test_hostile_first_frames_on_v1_stream_are_4400_naming_the_field(
        stack: str, frame: str, field: str, caplog: pytest.LogCaptureFixture) -> None:
    async with ws_connect(stack.replace("http", "ws") + "/v1/stream", max_size=None) as ws:
        await ws.send(frame)
        frames, code, _ = await frames_until_close(ws)
    assert code == 4400
    assert frames[0]["error"]["fields"][0]["field"].startswith(field), frames
    assert server_errors(caplog.records) == []


@pytest.mark.parametrize("frame", [
    "[" * 100_000 + "]" * 100_000,
    '{"type": "ping", "data": ' + "[" * 900 + "]" * 900 + "}",
    json.dumps({"type": "ping", "data": "\ud800"}),
])
async def test_hostile_frames_on_the_gateway_socket_are_4400(
        stack: str, frame: str, caplog: pytest.LogCaptureFixture) -> None:
    job = await submitted(stack)
    async with ws_connect(f"{job['stream_url']}?token={job['stream_token']}") as ws:
        assert json.loads(await ws.recv())["type"] == "queued"
        await ws.send(frame)
        frames, code, _ = await frames_until_close(ws)
    assert code == 4400
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_frame"
    assert server_errors(caplog.records) == []


@pytest.fixture(autouse=True)
def _server_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(body=request_bodies() | json_values,
       key=st.none() | st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=20),
       raw=st.none() | st.binary(max_size=200))
def test_any_body_on_v1_jobs_gets_an_answer_below_500(
        stack: str, body: object, key: str | None, raw: bytes | None) -> None:
    headers: dict[str, str | bytes] = {"content-type": "application/json"}
    if key is not None:  # any text, as its UTF-8 bytes (a header is bytes on the wire)
        headers["Idempotency-Key"] = key.encode()
    content = raw if raw is not None else json.dumps(body).encode()
    with httpx.Client(timeout=10) as http:
        try:
            response = http.post(f"{stack}/v1/jobs", content=content, headers=headers)
        except httpx.LocalProtocolError:
            return  # a header the client itself will not send (leading or trailing space)
    assert response.status_code in (200, 202, 400, 409, 413, 422), response.text
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


async def test_a_unicode_digit_content_length_is_not_a_500(admission: Admission) -> None:
    # uvicorn's parser refuses such a header itself; another ASGI server may pass it on, so
    # the app is called directly with it (an HTTP client would send its own Content-Length).
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", model=MODEL),
                     admission=admission)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/jobs", "raw_path": b"/v1/jobs",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("test", 80), "headers": [(b"host", b"test"),
                                                 (b"content-length", b"\xb2")]}  # latin-1 "²"
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    with contextlib.suppress(Exception):  # Starlette re-raises after its 500
        await app(scope, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 400, body
    assert json.loads(body)["error"]["fields"][0]["field"] == "body"
