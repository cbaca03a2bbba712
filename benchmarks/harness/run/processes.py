"""Processes a benchmark starts: a free port, a child that logs to a file and dies with the
benchmark, its CPU time, stopping children in order, and waiting until something is ready.

Children start in the checkout (``ROOT``) with ``PYTHONSAFEPATH=1`` in their environment (the
stack's ``base_env`` sets it; ``safe_env`` for any other), so the checkout's folders never hide
installed packages (``kernels/`` is ``tidegate.kernels``, not Hugging Face's ``kernels``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: Ctrl-C and exceptions still stop everything


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """A child in its own session, output to ``log_path``, killed if the benchmark dies."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent)


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 40) -> None:
    """SIGTERM all, then wait for each (SIGKILL past ``timeout_s``: a worker drains up to 30 s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (command line, user + system CPU seconds so far)} of a process and every process
    below it (a launcher's children: ``tidegate up``'s redis-server, worker, batch worker)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    out: dict[int, tuple[str, float]] = {}
    for p in tree:
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            out[p] = (argv, cpu_seconds(p))
        except OSError:
            continue
    return out


def http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine (all cores) so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def safe_env(**extra: str) -> dict[str, str]:
    """This process's environment, ``PYTHONSAFEPATH=1`` and ``extra`` on top."""
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, *,
               proc: subprocess.Popen | None = None, interval_s: float = 0.1) -> None:
    """Poll ``check`` (an ``OSError`` counts as not yet) until it holds; ``RuntimeError`` past
    ``timeout_s`` or as soon as ``proc``, the process being waited for, has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s")
        time.sleep(interval_s)
