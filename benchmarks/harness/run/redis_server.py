"""A private ``redis-server`` on a free port: its command line, the PING that says it answers,
and ``RedisServer``, which starts one, waits for it and stops it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tidegate.benchmarks.harness.run.processes import free_port, stop_processes


def redis_argv(exe: str, port: int, data_dir: Path, *, appendfsync: str | None = None,
               maxclients: int | None = None) -> list[str]:
    """No RDB snapshots; ``appendfsync`` (``everysec``, ``always``) turns the AOF on."""
    persistence = (["--appendonly", "no"] if appendfsync is None
                   else ["--appendonly", "yes", "--appendfsync", appendfsync])
    argv = [shutil.which(exe) or exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            *persistence, "--dir", str(data_dir), "--protected-mode", "no"]
    return argv + (["--maxclients", str(maxclients)] if maxclients else [])


def redis_answers(port: int) -> bool:
    """PONG to a PING (not while it loads its AOF: that answers ``-LOADING``)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """``with RedisServer() as r: r.url``: started and answering inside, stopped after; its data
    in a temporary directory (or ``data_dir``); ``prefix``: e.g. ``["taskset", "-c", "1"]``."""

    def __init__(self, *, exe: str = "redis-server", appendfsync: str | None = None,
                 maxclients: int | None = None, data_dir: Path | None = None,
                 prefix: list[str] | None = None, timeout_s: float = 20) -> None:
        self.port = free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tidegate-redis-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        argv = redis_argv(exe, self.port, self.data_dir, appendfsync=appendfsync,
                          maxclients=maxclients)
        if shutil.which(argv[0]) is None:
            raise RuntimeError(f"{exe} is not installed")
        self.proc = subprocess.Popen([*(prefix or []), *argv], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=dict(os.environ))
        deadline = time.monotonic() + timeout_s
        while not redis_answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer within {timeout_s:.0f} s")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_processes([self.proc], timeout_s=10)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
