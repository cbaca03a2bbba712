"""Batches the way a batch submitter runs them: `tidegate batch submit|status|results|cancel`
against a real redis-server, a real worker and `tidegate batch-worker` (arq), all processes;
10,000 lines with the batch worker restarted mid-batch lose and duplicate no line."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import RedisServer, free_port
from tests.stack_process import TIDEGATE, stop
from tidegate import keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def start(*args: str, url: str) -> subprocess.Popen:
    env = {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_METRICS_PORT": "0",
           "TIDEGATE_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([*TIDEGATE, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def cli(*args: str, url: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIDEGATE_REDIS_URL": url}
    return subprocess.run([*TIDEGATE, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def stack(redis_server: RedisServer) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A worker (tiny random model) and a batch worker (admitting the same model) on a flushed
    redis-server; the test may add processes to the list, all stopped at the end."""
    redis_server.flush()
    url = redis_server.url
    procs = [start("worker", "--model", "random:tiny", "--max-num-seqs", "64",
                   "--max-num-batched-tokens", "512", url=url),
             start("batch-worker", "--status-port", "0", "--model", "random:tiny", url=url)]
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 120
    try:
        while not list(client.scan_iter(match=keys.worker_heartbeat("*"))):
            assert procs[0].poll() is None, procs[0].stderr.read() if procs[0].stderr else ""
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)
        yield url, procs
    finally:
        for proc in procs:
            stop(proc)
        client.close()


def write_batch(path: Path, n: int, bad_every: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            body = ({"prompt": "bad", "max_tokens": -1} if i % bad_every == 0 else
                    {"model": "tidegate", "prompt": f"line {i}", "max_tokens": 2})
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/jobs",
                                "body": body}) + "\n")


def wait_done(batch_id: str, url: str) -> dict:
    out = cli("batch", "status", batch_id, "--wait", "--json", url=url, timeout=400)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_ten_thousand_lines_survive_a_batch_worker_restart(
        stack: tuple[str, list[subprocess.Popen]], tmp_path: Path) -> None:
    url, procs = stack
    n, bad_every = 10_000, 997
    write_batch(tmp_path / "in.jsonl", n, bad_every)
    out = cli("batch", "submit", str(tmp_path / "in.jsonl"), url=url)
    assert out.returncode == 0, out.stderr
    batch_id = out.stdout.strip()
    client = redis.Redis.from_url(url, decode_responses=True)
    # Restart the batch worker while it is queuing lines.
    deadline = time.monotonic() + 60
    while client.hlen(keys.batch_enqueued(batch_id)) < 1500:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stop(procs[1])  # SIGTERM: arq cancels the running step, which the next worker reruns
    procs.append(start("batch-worker", "--status-port", "0", "--model", "random:tiny", url=url))
    state = wait_done(batch_id, url)
    invalid = len(range(0, n, bad_every))
    assert state["status"] == "completed" and state["total"] == state["done"] == n
    assert state["failed"] == invalid
    result = cli("batch", "results", batch_id, "-o", str(tmp_path / "out.jsonl"), url=url)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"c{i}" for i in range(n)]  # input order, once
    errors = [i for i, x in enumerate(lines) if x["error"] is not None]
    assert errors == list(range(0, n, bad_every))
    assert all(lines[i]["error"]["code"] == "invalid_request" for i in errors)
    ok = [x for x in lines if x["error"] is None]
    assert all(x["response"]["status_code"] == 200 and
               x["response"]["body"]["usage"]["completion_tokens"] == 2 for x in ok)
    # One job per valid line, however often a line was queued.
    jobs = [k for k in client.scan_iter(match=keys.job_hash(f"{batch_id}-*"), count=1000)
            if not k.endswith((":events", ":live"))]
    assert len(jobs) == n - invalid
    client.close()


def test_cancel_ends_the_batch_with_every_line_accounted_for(
        stack: tuple[str, list[subprocess.Popen]], tmp_path: Path) -> None:
    url, _ = stack
    with (tmp_path / "in.jsonl").open("w") as f:
        for i in range(300):
            f.write(json.dumps({"custom_id": f"c{i}", "body": {
                "prompt": f"line {i}", "max_tokens": 200}}) + "\n")
    batch_id = cli("batch", "submit", str(tmp_path / "in.jsonl"), url=url).stdout.strip()
    # Cancel once the batch worker has begun queuing its lines (not after a fixed second).
    client = redis.Redis.from_url(url, decode_responses=True)
    deadline = time.monotonic() + 60
    while client.hlen(keys.batch_enqueued(batch_id)) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.close()
    out = cli("batch", "cancel", batch_id, url=url)
    assert out.returncode == 0, out.stderr
    state = wait_done(batch_id, url)
    assert state["status"] == "cancelled" and state["done"] == 300
    lines = [json.loads(x) for x in cli("batch", "results", batch_id, url=url).stdout.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"c{i}" for i in range(300)]
    cancelled = [x for x in lines if x["error"] and x["error"]["code"] == "cancelled"]
    assert cancelled and state["failed"] == sum(x["error"] is not None for x in lines)


def test_bad_input_exits_with_a_message(redis_server: RedisServer, tmp_path: Path) -> None:
    url = redis_server.url
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "body": {"prompt": "x"}}\n{oops\n')
    out = cli("batch", "submit", str(bad), url=url)
    assert out.returncode == 2 and "line 2" in out.stderr and "Traceback" not in out.stderr
    bad.write_text('{"custom_id": "a", "body": {}}\n{"custom_id": "a", "body": {}}\n')
    out = cli("batch", "submit", str(bad), url=url)
    assert out.returncode == 2 and "repeated" in out.stderr
    out = cli("batch", "submit", str(tmp_path / "missing.jsonl"), url=url)
    assert out.returncode == 2 and "missing.jsonl" in out.stderr
    out = cli("batch", "status", "nope", url=url)
    assert out.returncode == 2 and "batch id" in out.stderr
    out = cli("batch", "status", "batch_" + "0" * 32, url=url)
    assert out.returncode == 1 and "not found" in out.stderr


def test_batch_worker_health_follows_redis(redis_server: RedisServer) -> None:
    port = free_port()
    proc = start("batch-worker", "--status-port", str(port), url=redis_server.url)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        redis_server.stop()
        try:
            r = httpx.get(f"{base}/readyz", timeout=10)
            assert r.status_code == 503 and r.json()["reason"] == "Redis is unreachable"
            time.sleep(2)  # long enough for arq's worker to notice and be started again
        finally:
            redis_server.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert proc.poll() is None  # it outlived the outage
    finally:
        stop(proc)



def test_a_line_naming_no_served_model_ends_model_not_found(
        stack: tuple[str, list[subprocess.Popen]], tmp_path: Path) -> None:
    url, _ = stack
    with (tmp_path / "in.jsonl").open("w") as f:
        for i, model in enumerate(["random:tiny", "gpt-4o", None, "random_tiny:nope"]):
            body = {"prompt": f"line {i}", "max_tokens": 2, **({"model": model} if model else {})}
            f.write(json.dumps({"custom_id": f"c{i}", "body": body}) + "\n")
    batch_id = cli("batch", "submit", str(tmp_path / "in.jsonl"), url=url).stdout.strip()
    state = wait_done(batch_id, url)
    assert state["status"] == "completed" and state["failed"] == 2
    lines = [json.loads(x) for x in cli("batch", "results", batch_id, url=url).stdout.splitlines()]
    # "random_tiny:nope" names an adapter of the served model: its worker finds none.
    assert [x["error"]["code"] if x["error"] else None for x in lines] == [
        None, "model_not_found", None, "adapter_not_found"]
