"""`tidegate up` as a subprocess on the tests' redis-server, the way a user starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import RedisServer, free_port
from tests.redis_cluster import ClusterServers
from tidegate import keys
from tidegate.redis_conn import connect_sync

TIDEGATE = [sys.executable, "-m", "tidegate"]


@contextmanager
def tidegate_up(redis_server: RedisServer | ClusterServers, *, model: str = "smollm2",
                startup_timeout_s: float = 120) -> Iterator[str]:
    """Yields the stack's base URL once its worker heartbeats; on exit, SIGTERM, and checks
    that no worker outlives it."""
    redis_server.flush()  # no job left queued by an earlier test reaches this worker
    port = free_port()
    env = {**os.environ, "TIDEGATE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [*TIDEGATE, "up", "--redis-url", redis_server.url, "--port", str(port), "--model", model],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + startup_timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:  # `up` prints its banner once a worker is heartbeating
        if "tidegate is up" in line:
            break
        assert time.monotonic() < deadline and proc.poll() is None, line
    else:
        pytest.fail(f"tidegate up exited ({proc.wait()}) before it was up")
    # Keep draining its output so a full pipe can never stall the stack.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        workers = children(proc.pid)
        proc.terminate()
        proc.wait(60)
        deadline = time.monotonic() + 30
        while (alive := [pid for pid in workers if is_alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"tidegate up left its worker(s) {alive} running"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as an operator stops a process; killed if it has not left in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``tidegate ARGS...`` as a user runs it: its exit code and output."""
    return subprocess.run([*TIDEGATE, *args], capture_output=True, text=True, timeout=timeout)


def run_batch(lines: list[dict], redis_url: str, folder: Path,
              timeout_s: float = 300) -> list[dict]:
    """Submit ``lines`` as a JSONL batch with the CLI, wait until it completes, and return its
    output lines (input order)."""
    path = folder / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = cli("batch", "submit", str(path), "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    batch_id = out.stdout.strip()
    status = cli("batch", "status", batch_id, "--wait", "--json", "--redis-url", redis_url,
                 timeout=timeout_s)
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "completed"
    results = cli("batch", "results", batch_id, "--redis-url", redis_url)
    return [json.loads(x) for x in results.stdout.splitlines()]


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(check: Callable[[], object], what: str, timeout_s: float = 120.0) -> None:
    """Poll ``check`` every 0.1 s until it is truthy; fail naming ``what`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out ({timeout_s:.0f} s) waiting for {what}"
        time.sleep(0.1)


def heartbeat_of(url: str, pid: int) -> str | None:
    """The worker id of process ``pid`` once it heartbeats (ids are host-PID-random)."""
    client = connect_sync(url, decode_responses=True)
    try:
        for key in client.scan_iter(match=keys.worker_heartbeat("*")):
            worker_id = key.split("{", 1)[1].rstrip("}")
            if f"-{pid}-" in worker_id and client.get(key):
                return worker_id
        return None
    finally:
        client.close()
