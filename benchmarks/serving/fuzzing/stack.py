"""``tidegate up`` as a user starts it (auth on, two keys, the tiny random model), its whole
output (API, gateway and worker) in one log file, on a redis-server of its own or a given one."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free port (no persistence); yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tidegate-fuzz-redis-") as workdir:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--dir", workdir, "--protected-mode", "no"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def tidegate_up(redis_url: str, log: Path, *, startup_timeout_s: float = 180,
                log_level: str = "INFO") -> Iterator[FuzzStack]:
    """The stack, up once its worker heartbeats; stopped (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    env = {**os.environ, "TIDEGATE_API_KEYS": ",".join(KEYS),
           "TIDEGATE_LOG_LEVEL": log_level, "TIDEGATE_METRICS_PORT": str(free_port())}
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
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
