"""No key, stream token or key-derived value in any byte any process writes, at every log level.

The stack runs as separate processes, the way an operator runs it: redis-server, `tidegate api`
(access log on), `tidegate gateway`, `tidegate worker`, `tidegate batch-worker` (arq) and a
`tidegate submit` client, all at
TRACE (below DEBUG: uvicorn's protocol traces and ASGI messages, websockets' handshake headers
and frames, redis-py, asyncio in debug mode, arq, our own loggers), with auth on and two
tenants in a keys file. Every route that carries a key or a token is driven, with the right
credentials and with wrong ones in every scheme, then each process's stdout and stderr are
searched for every secret used, what derives from it, and base64 of ``user:key``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import free_port
from tests.stack_process import TIDEGATE
from tidegate.http.auth import tenant_of, token_hash

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KEY_A = "tg-alpha-Zq8Wm3Rk5Tn7Vb2Xc4Yd6Fh9Jp1Ls0Ue"
KEY_B = "tg-bravo-Nd2Gq7Hs4Kw9Mz1Pv6Rx3Ty8Cb5Fj0La"
WRONG = "tg-wrong-Pj4Ks8Ld2Mf6Ng1Qh5Rj9St3Tk7Ul0Vm"  # configured nowhere
WRONG_TOKEN = "Xy7Kq2Lm9Np4Rs6Tv1Wz3Bc8Df5Gh0Jk-Mn_Pq2Rs4"  # shaped like a stream token
LOGS = {"TIDEGATE_LOG_LEVEL": "TRACE", "PYTHONASYNCIODEBUG": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    out: Path
    err: Path

    def output(self) -> bytes:
        return self.out.read_bytes() + self.err.read_bytes()


@dataclass
class Stack:
    api: str
    gateway: str
    processes: list[Process] = field(default_factory=list)
    secrets: set[str] = field(default_factory=set)  # every key and token the test used

    def ws(self, base: str, path: str) -> str:
        return base.replace("http://", "ws://") + path

    def stop(self) -> None:
        """SIGTERM to every process (Redis last, so the others shut down cleanly), then wait."""
        for group in (self.processes[1:], self.processes[:1]):
            for process in group:
                if process.proc.poll() is None:
                    process.proc.send_signal(signal.SIGTERM)
            for process in group:
                try:
                    process.proc.wait(30)
                except subprocess.TimeoutExpired:
                    process.proc.kill()
                    process.proc.wait(10)


def spawn(name: str, args: list[str], env: dict[str, str], logs: Path) -> Process:
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(args, env=env, stdout=o, stderr=e)
    return Process(name, proc, out, err)


def wait_until(what: str, ready, process: Process, timeout_s: float = 90) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert process.proc.poll() is None, f"{what} exited:\n{process.output()[-3000:]!r}"
        assert time.monotonic() < deadline, f"{what} not ready in {timeout_s} s"
        time.sleep(0.1)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    keys_file = logs / "keys"
    keys_file.write_text(f"# two tenants\n{KEY_A}\n\n{KEY_B}\n")
    redis_port, api_port, gw_port = free_port(), free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    api, gateway = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gw_port}"
    env = {**os.environ, **LOGS, "TIDEGATE_REDIS_URL": redis_url,
           "TIDEGATE_API_KEYS_FILE": str(keys_file), "TIDEGATE_GATEWAY_URL": gateway.replace("http:", "ws:"),
           "TIDEGATE_MODEL": "random:tiny", "TIDEGATE_KV_CACHE_GB": "0.05",
           "TIDEGATE_METRICS_PORT": str(free_port())}
    stack = Stack(api, gateway)
    server = spawn("redis", [str(shutil.which("redis-server")), "--port", str(redis_port),
                             "--bind", "127.0.0.1", "--save", "", "--loglevel", "debug",
                             "--dir", str(logs)], env, logs)
    stack.processes.append(server)
    wait_until("redis-server", lambda: _pings(redis_port), server, 10)
    for name, args in [("worker", ["worker"]),
                       ("api", ["api", "--port", str(api_port), "--access-log"]),
                       ("gateway", ["gateway", "--port", str(gw_port)]),
                       ("batch-worker", ["batch-worker", "--status-port", "0"])]:
        stack.processes.append(spawn(name, [*TIDEGATE, *args], env, logs))
    worker, api_process, gateway_process, _ = stack.processes[1:]
    client = redis.Redis(port=redis_port)
    wait_until("the worker", lambda: bool(client.keys("tidegate:worker:*")), worker)
    client.close()
    wait_until("the API", lambda: answers(f"{api}/readyz"), api_process)
    wait_until("the gateway", lambda: answers(f"{gateway}/readyz"), gateway_process)
    try:
        yield stack
    finally:
        stack.stop()


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port).ping())
    except redis.ConnectionError:
        return False


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(key: str, user: str = "someone") -> str:
    return base64.b64encode(f"{user}:{key}".encode()).decode()


WRONG_CREDENTIALS = [  # each must be refused, and none may be logged
    bearer(WRONG), {"Authorization": f"Basic {basic(KEY_A)}"}, {"Authorization": f"Token {KEY_A}"},
    {"Authorization": f"Bearer {KEY_A},{KEY_B}"}, {"Authorization": KEY_A},
    {"Authorization": f"Basic {basic(WRONG, 'x')}"}, {"X-Api-Key": KEY_A},
    {"Authorization": f"bearer  {WRONG}"}, {"Cookie": f"api_key={KEY_B}"},
]


async def frames(url: str, headers: dict[str, str] | None = None, *, send: list[dict] = (),
                 subprotocols: list[str] | None = None, limit_s: float = 30,
                 ) -> tuple[list[dict], int | None]:
    """Every frame until the server closes, and its close code (the HTTP status if refused)."""
    got: list[dict] = []
    try:
        async with ws_connect(url, additional_headers=headers or {},
                              subprotocols=subprotocols) as ws:  # type: ignore[arg-type]
            for frame in send:
                await ws.send(json.dumps(frame))
            try:
                async with asyncio.timeout(limit_s):
                    async for raw in ws:
                        got.append(json.loads(raw))
            except ConnectionClosed:
                pass
        return got, ws.close_code
    except InvalidStatus as exc:
        return got, exc.response.status_code


@asynccontextmanager
async def http(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        yield client


async def submit(api: httpx.AsyncClient, key: str, stack: Stack, **body: object) -> dict:
    response = await api.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 8, **body},
                              headers=bearer(key))
    assert response.status_code == 202, response.text
    job = response.json()
    stack.secrets.add(job["stream_token"])
    return job


async def drive_http_api(stack: Stack) -> dict:
    async with http(stack.api) as api:
        job_a = await submit(api, KEY_A, stack)
        job_b = await submit(api, KEY_B, stack)
        again = await api.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 8},
                               headers={**bearer(KEY_A), "Idempotency-Key": "k-1"})
        repeat = await api.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 8},
                                headers={**bearer(KEY_A), "Idempotency-Key": "k-1"})
        assert again.json()["stream_token"] == repeat.json()["stream_token"]
        stack.secrets.add(again.json()["stream_token"])
        for headers in [*WRONG_CREDENTIALS, {}]:
            assert (await api.post("/v1/jobs", json={"prompt": "x"}, headers=headers)
                    ).status_code == 401
            assert (await api.get(f"/v1/jobs/{job_a['id']}", headers=headers)).status_code == 401
            assert (await api.post(f"/v1/jobs/{job_a['id']}/cancel", headers=headers)
                    ).status_code == 401
            assert (await api.get("/v1/models", headers=headers)).status_code == 401
        assert (await api.get(f"/v1/jobs/{job_a['id']}", headers=bearer(KEY_B))).status_code == 403
        assert (await api.post(f"/v1/jobs/{job_a['id']}/cancel", headers=bearer(KEY_B))
                ).status_code == 403
        long_job = await submit(api, KEY_A, stack, max_tokens=2000)
        assert (await api.post(f"/v1/jobs/{long_job['id']}/cancel", headers=bearer(KEY_A))
                ).status_code in (200, 202)
        # ?token= on the API (not a route that takes one, and logged by its access log)
        await api.get(f"/v1/jobs/{job_a['id']}?token={job_a['stream_token']}")
        assert (await api.get("/v1/models", headers=bearer(KEY_B))).status_code == 200
        await drive_openai(api)
        for _ in range(100):
            done = (await api.get(f"/v1/jobs/{job_a['id']}", headers=bearer(KEY_A))).json()
            if done["status"] == "done":
                break
            await asyncio.sleep(0.1)
        assert done["status"] == "done", done
    return {"a": job_a, "b": job_b}


async def drive_openai(api: httpx.AsyncClient) -> None:
    chat = {"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6}
    async with api.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                          headers=bearer(KEY_A)) as streamed:
        assert streamed.status_code == 200
        body = b"".join([chunk async for chunk in streamed.aiter_bytes()])
    assert body.rstrip().endswith(b"data: [DONE]")
    response = await api.post("/v1/completions", headers=bearer(KEY_B),
                              json={"model": "random:tiny", "prompt": "hi", "max_tokens": 6})
    assert response.status_code == 200, response.text
    for headers in WRONG_CREDENTIALS:
        assert (await api.post("/v1/chat/completions", json=chat, headers=headers)
                ).status_code == 401


async def drive_socket_submit(stack: Stack, job_a: dict) -> None:
    url = stack.ws(stack.api, "/v1/stream")
    request = {"prompt": "hello", "max_tokens": 8}
    got, code = await frames(url, send=[{"type": "generate", "request": request,
                                         "api_key": KEY_A}])
    assert got[0]["type"] == "accepted" and got[-1]["type"] == "done" and code == 1000
    stack.secrets.add(got[0]["stream_token"])
    got, code = await frames(url, bearer(KEY_B), send=[{"type": "generate", "request": request}])
    assert got[0]["type"] == "accepted" and code == 1000
    stack.secrets.add(got[0]["stream_token"])
    for frame in [{"type": "generate", "request": request, "api_key": WRONG},
                  {"type": "generate", "request": request, "api_key": f"Basic {basic(KEY_A)}"},
                  {"type": "resume", "job_id": job_a["id"], "api_key": WRONG}]:
        got, code = await frames(url, send=[frame])
        assert code == 4401, (frame, got)
    got, code = await frames(url, send=[{"type": "resume", "job_id": job_a["id"],
                                         "api_key": KEY_B}])
    assert code == 4403
    got, code = await frames(url, send=[{"type": "resume", "job_id": job_a["id"],
                                         "token": job_a["stream_token"]}])
    assert got[-1]["type"] == "done" and code == 1000
    got, code = await frames(url, send=[{"type": "resume", "job_id": job_a["id"],
                                         "token": WRONG_TOKEN}])
    assert code == 4403


async def drive_gateway(stack: Stack, jobs: dict) -> None:
    job_a, job_b = jobs["a"], jobs["b"]
    path = f"/v1/jobs/{job_a['id']}/stream"
    url = stack.ws(stack.gateway, path)
    for query, headers in [(f"?token={job_a['stream_token']}", {}), ("", bearer(KEY_A)),
                           (f"?token={job_a['stream_token']}&last_event_id=2", bearer(WRONG))]:
        got, code = await frames(url + query, headers)
        assert got[-1]["type"] == "done" and code == 1000, (query, headers, got)
    for query, headers in [(f"?token={job_b['stream_token']}", {}), (f"?token={WRONG_TOKEN}", {}),
                           ("", bearer(KEY_B)), ("", {"X-Api-Key": KEY_A}),
                           ("", {"Sec-WebSocket-Protocol": KEY_A}),
                           *(("", h) for h in WRONG_CREDENTIALS)]:
        got, code = await frames(url + query, headers)
        assert code in (4401, 4403) and got == [], (query, headers, got, code)
    for offered in ([KEY_A], ["tidegate", WRONG, KEY_B]):  # a browser's only header
        got, code = await frames(url, subprotocols=offered)
        assert code == 4401
    async with http(stack.gateway) as gateway:
        events = f"/v1/jobs/{job_a['id']}/events"
        for query, headers in [(f"?token={job_a['stream_token']}", {}),
                               ("", bearer(KEY_A)),
                               (f"?token={job_a['stream_token']}", {"Last-Event-ID": "1"})]:
            response = await gateway.get(events + query, headers=headers)
            assert response.status_code == 200 and b"done" in response.content
        for query, headers in [(f"?token={WRONG_TOKEN}", {}), ("", bearer(KEY_B)),
                               *(("", h) for h in WRONG_CREDENTIALS)]:
            assert (await gateway.get(events + query, headers=headers)).status_code in (401, 403)
        assert (await gateway.get("/v1/queue", headers=bearer(KEY_A))).status_code == 200
        assert (await gateway.get("/v1/queue", headers=bearer(WRONG))).status_code == 401


def run_cli_submit(stack: Stack, logs: Path) -> None:
    env = {**os.environ, **LOGS, "TIDEGATE_API_KEY": KEY_B}
    process = spawn("submit", [*TIDEGATE, "submit", "hello", "--raw", "--stream", "--max-tokens",
                               "8", "--url", stack.api], env, logs)
    assert process.proc.wait(60) == 0, process.output()[-3000:]
    stack.processes.append(process)


def forbidden(secret: str) -> list[str]:
    """What may not appear of a key or a token: any 12 characters of it or of what a process
    derives from it (websockets prints a long frame's start and end: a piece is a leak too), and
    how Basic credentials carry it (base64 of ``user:key``, whole)."""
    whole = [secret, tenant_of(secret), token_hash(secret)]  # token_hash: a key's digest too
    pieces = [w[i:i + 12] for w in whole for i in range(len(w) - 11)]
    return pieces + [basic(secret, user) for user in ("someone", "x", "")]


async def test_no_key_or_token_in_any_output_of_any_process(
        stack: Stack, tmp_path: Path) -> None:
    jobs = await drive_http_api(stack)
    await drive_socket_submit(stack, jobs["a"])
    await drive_gateway(stack, jobs)
    await asyncio.to_thread(run_cli_submit, stack, tmp_path)
    stack.stop()  # what they log while shutting down is searched too
    stack.secrets |= {KEY_A, KEY_B, WRONG, WRONG_TOKEN}
    outputs = {p.name: p.output() for p in stack.processes}
    leaks = {(name, s) for name, data in outputs.items()
             for secret in stack.secrets for s in forbidden(secret) if s.encode() in data}
    assert not leaks, f"{len(leaks)} secrets in the logs: {sorted(leaks)[:5]}"
    # The logs were there to search: at TRACE, uvicorn's handshake headers, frames, ASGI
    # messages and the access lines (with their ?token=) were all written, and none was lost.
    api, gateway = outputs["api"].decode(), outputs["gateway"].decode()
    assert "< authorization: [redacted]" in api.lower() and "< TEXT '{\"type\": \"generate\"" in api
    assert "api_key\": \"[redacted]" in api and "_token\": \"[redacted]" in api
    assert "ASGI [" in gateway and "token=[redacted]" in gateway
    assert f"GET /v1/jobs/{jobs['a']['id']}?token=[redacted] HTTP/1.1\" 401" in api
    assert f"GET /v1/jobs/{jobs['a']['id']}/events?token=[redacted] HTTP/1.1\" 200" in gateway
    for name, text in outputs.items():
        assert b"Logging error" not in text and b"Traceback" not in text, name
