"""`tidegate up` as a subprocess on the tests' redis-server, the way a user starts it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import RedisServer, free_port

TIDEGATE = [sys.executable, "-m", "tidegate"]


@contextmanager
def tidegate_up(redis_server: RedisServer, *, model: str = "smollm2",
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
