"""Several models through real processes: one API serving two models, a worker per model (and
one process serving both), on a real redis-server. Each model's jobs reach only its workers,
/v1/models counts the live ones, and a model whose worker stopped has its jobs rejected
``no_worker`` at their deadline."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from tests.conftest import RedisServer, free_port
from tests.stack_process import TIDEGATE, stop
from tidegate import keys
from tidegate.events.event_feed import stored_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODELS = ("chat=random:tiny", "code=random:tiny")


def start(*args: str, url: str, **env: str) -> subprocess.Popen:
    full = {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_LOG_LEVEL": "WARNING",
            "TIDEGATE_METRICS_PORT": "0", "TIDEGATE_KV_CACHE_GB": "0.1",
            "TIDEGATE_TORCH_THREADS": "1", **env}
    return subprocess.Popen([*TIDEGATE, *args], env=full, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_until(check, what: str, timeout_s: float = 120) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def live_workers(url: str) -> dict[str, str]:
    """Model -> worker id, from the live heartbeats."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        found = {}
        for key in client.scan_iter(match=keys.worker_heartbeat("*")):
            beat = client.get(key)
            if beat:
                found[json.loads(beat)["model"]] = key.split("{", 1)[1].rstrip("}")
        return found
    finally:
        client.close()


def api_ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def api(redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    """The API serving both models (no worker yet): (base URL, Redis URL)."""
    redis_server.flush()
    port = free_port()
    proc = start("api", "--model", MODELS[0], "--model", MODELS[1], "--port", str(port),
                 url=redis_server.url)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: api_ready(base) or proc.poll() is not None, "the API")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield base, redis_server.url
    finally:
        stop(proc)


async def run_job(http: httpx.AsyncClient, url: str, **body: object) -> tuple[dict, list]:
    """Submit, wait for the result; the result and the job's stored events."""
    job = (await http.post("/v1/jobs", json={"prompt": "hello there", "max_tokens": 4,
                                              **body}))
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    deadline = time.monotonic() + 120
    while (result := (await http.get(f"/v1/jobs/{job_id}")).json())["status"] in (
            "queued", "running"):
        assert time.monotonic() < deadline, result
        await asyncio.sleep(0.1)
    r = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        events = [e.data() for e in await stored_events(r, job_id)]
    finally:
        await r.aclose()
    return result, events


async def test_each_model_s_jobs_reach_only_its_worker_then_no_worker_at_the_deadline(
        api: tuple[str, str]) -> None:
    base, url = api
    workers = {m.split("=")[0]: start("worker", "--model", m, url=url) for m in MODELS}
    try:
        wait_until(lambda: set(live_workers(url)) == {"chat", "code"}
                   or any(p.poll() is not None for p in workers.values()), "both workers")
        for proc in workers.values():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        ids = live_workers(url)
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            cards = (await http.get("/v1/models")).json()["data"]
            assert [(c["id"], c["live_workers"]) for c in cards] == [("chat", 1), ("code", 1)]
            for model in ("chat", "code", "tidegate", "chat", "code"):
                result, events = await run_job(http, url, model=model)
                served = "chat" if model == "tidegate" else model
                assert result["status"] == "done" and result["model"] == served
                [started] = [e for e in events if e["type"] == "started"]
                assert started["worker"] == ids[served]
            for path, body in (("/v1/jobs", {"prompt": "hi", "model": "nope"}),
                               ("/v1/chat/completions", {"model": "nope", "messages": [
                                   {"role": "user", "content": "hi"}]})):
                r = await http.post(path, json=body)
                assert r.status_code == 404 and "model_not_found" in r.text
            stop(workers["code"])
            wait_until(lambda: set(live_workers(url)) == {"chat"}, "the code worker to stop")
            cards = (await http.get("/v1/models")).json()["data"]
            assert [(c["id"], c["live_workers"]) for c in cards] == [("chat", 1), ("code", 0)]
            started = time.monotonic()
            result, events = await run_job(http, url, model="code", timeout_s=2)
            waited = time.monotonic() - started
            assert result["status"] == "rejected" and result["error"]["code"] == "no_worker"
            assert "no worker serves model 'code'" in result["error"]["message"]
            assert [e["type"] for e in events] == ["queued", "rejected"]
            assert 1.9 < waited < 6  # at its deadline, within a sweep or two
            result, _ = await run_job(http, url, model="chat")  # the other model still runs
            assert result["status"] == "done"
    finally:
        for proc in workers.values():
            stop(proc)


async def test_one_worker_process_serves_two_models(api: tuple[str, str]) -> None:
    base, url = api
    metrics_port = free_port()
    worker = start("worker", "--model", MODELS[0], "--model", MODELS[1], url=url,
                   TIDEGATE_METRICS_PORT=str(metrics_port))
    try:
        wait_until(lambda: set(live_workers(url)) == {"chat", "code"} or worker.poll() is not None,
                   "the worker's two services")
        assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
        ids = live_workers(url)
        assert ids["chat"] != ids["code"] and ids["chat"].endswith("-chat")
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for model in ("chat", "code"):
                result, events = await run_job(http, url, model=model)
                assert result["status"] == "done"
                assert [e["worker"] for e in events if e["type"] == "started"] == [ids[model]]
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        for model in ("chat", "code"):
            assert f'tidegate_requests_finished_total{{model="{model}",reason="completed"}} 1.0' \
                in text
        assert text.count("# TYPE tidegate_requests_running gauge") == 1
    finally:
        stop(worker)
    assert worker.returncode == 0


def test_an_api_and_a_worker_given_different_models_say_so(redis_server: RedisServer) -> None:
    # A new user's first try: a worker on random:tiny, the API on its default model.
    redis_server.flush()
    url, port = redis_server.url, free_port()
    worker = start("worker", "--model", "random:tiny", url=url)
    api = start("api", "--port", str(port), url=url)
    lines: list[str] = []
    assert api.stderr is not None
    threading.Thread(target=lambda: lines.extend(api.stderr), daemon=True).start()
    try:
        wait_until(lambda: any("not started with" in line for line in lines)
                   or api.poll() is not None or worker.poll() is not None, "the API's warning")
        [warning] = [line for line in lines if "not started with" in line]
        assert "WARNING" in warning and "random_tiny (1 worker)" in warning
        assert "none serves SmolLM2-135M-Instruct" in warning
        cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["live_workers"]) for c in cards] == [("SmolLM2-135M-Instruct", 0)]
    finally:
        stop(api)
        stop(worker)
