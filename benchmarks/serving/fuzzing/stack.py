"""``tidegate up`` as a user starts it (auth on, two keys, the tiny random model), its whole
output (API, gateway and worker) in one log file, on a redis-server of its own or a given one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tidegate.benchmarks.harness.run.processes import ROOT, free_port, safe_env, stop_processes
from tidegate.benchmarks.harness.run.redis_server import RedisServer

KEYS = ("tg-fuzz-alpha-7c1e0d9a", "tg-fuzz-bravo-3b8f2e6c")
MODEL = "random:tiny"


@dataclass(frozen=True, slots=True)
class FuzzStack:
    base_url: str  # http://127.0.0.1:PORT
    log: Path
    keys: tuple[str, ...] = KEYS

    @property
    def ws_url(self) -> str:
        return "ws" + self.base_url[len("http"):]

    def auth(self, tenant: int = 0) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free port (no persistence); yields its URL."""
    with RedisServer() as server:
        yield server.url


@contextlib.contextmanager
def tidegate_up(redis_url: str, log: Path, *, startup_timeout_s: float = 180,
                log_level: str = "INFO") -> Iterator[FuzzStack]:
    """The stack, up once its worker heartbeats; stopped (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    env = safe_env(TIDEGATE_API_KEYS=",".join(KEYS), TIDEGATE_LOG_LEVEL=log_level,
                   TIDEGATE_METRICS_PORT=str(free_port()))
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidegate", "up", "--redis-url", redis_url,
             "--port", str(port), "--model", MODEL],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while "tidegate is up" not in log.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tidegate up did not come up; see {log}")
                time.sleep(0.2)
            yield FuzzStack(f"http://127.0.0.1:{port}", log)
        finally:
            stop_processes([proc], timeout_s=60)
