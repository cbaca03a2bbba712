"""`tidegate up` without any redis-server falls back to embedded fakeredis and still serves."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.metric_reference import assert_documented
from tests.stack_process import children
from tests.stack_process import is_alive as alive

pytestmark = pytest.mark.slow


def read_until_up(proc: subprocess.Popen, seen: list[str],
                  on_line: Callable[[str], None] = lambda _line: None) -> None:
    """Read `up`'s output into ``seen`` (``on_line`` sees each line) until its banner, then keep
    draining it in the background so a full pipe never stalls the stack."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    for line in proc.stdout:
        seen.append(line)
        on_line(line)
        if "tidegate is up" in line:
            break
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
    threading.Thread(target=proc.stdout.read, daemon=True).start()


def test_up_without_redis_server_uses_embedded_fakeredis_and_answers(tmp_path: Path) -> None:
    port = free_port()
    # A PATH holding only this interpreter's directory: no redis-server to be found.
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "TIDEGATE_LOG_LEVEL": "WARNING"}
    env.pop("REDIS_URL", None)
    env.pop("TIDEGATE_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidegate", "up", "--port", str(port), "--model", "random:tiny"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen: list[str] = []
    try:
        read_until_up(proc, seen)
        assert any("fakeredis" in line for line in seen), "".join(seen)
        out = subprocess.run(
            [sys.executable, "-m", "tidegate", "submit", "hello", "--raw", "--max-tokens", "5",
             "--stream", "--url", f"http://127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert out.returncode == 0, out.stderr
        # One /metrics for the API and the gateway: the queue and the API's routes (a prompt
        # shorter than a KV block has nothing to route: the shared lane).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert 'tidegate_routed_jobs_total{model="random_tiny",route="shared"} 1.0' in metrics
        assert "tidegate_queue_lag" in metrics
        assert_documented(metrics)
        # SIGTERM (docker stop, systemd) stops `up` and its worker with it: no orphan.
        workers = children(proc.pid)
        assert workers, "up runs its worker as a child process"
        proc.terminate()
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"worker {workers} outlived `tidegate up`"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)



def test_up_waits_for_a_redis_that_is_not_there_yet(tmp_path: Path) -> None:
    """Redis down at start (a restart, a slow container): `up` warns and waits, with no
    traceback, and is up once Redis answers."""
    from tests.conftest import RedisServer

    server = RedisServer(free_port(), tmp_path)
    port = free_port()
    env = {**os.environ, "TIDEGATE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidegate", "up", "--port", str(port), "--model", "random:tiny",
         "--redis-url", server.url],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen: list[str] = []

    def on_line(line: str) -> None:
        if "waiting for redis" in line and server.proc is None:
            server.start()

    try:
        read_until_up(proc, seen, on_line)
        assert server.proc is not None, "".join(seen)  # it waited, then came up
        assert not any("Traceback" in line for line in seen), "".join(seen)
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        server.stop()
