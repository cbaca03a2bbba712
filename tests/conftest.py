"""Shared fixtures: a real redis-server per test session on a free port, killable per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis


def _threads_per_process() -> int:
    """The CPUs shared evenly among the pytest-xdist processes (``make test`` runs one per
    CPU). torch's pool defaults to every CPU in each process: two processes on two CPUs then
    run four busy threads, and OpenMP's waiting threads spin on CPUs the other process needs
    (two processes ran the engine tests 2.5x slower than with one thread each)."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // processes)


def _users_own(name: str) -> str:
    """``name`` as the user's shell gave it ("" if unset), not as this file set it: the run's
    first process records it, and pytest-xdist's processes, which inherit that process's
    environment with this file's choices in it, read the record."""
    record = f"TIDEGATE_TESTS_USER_{name}"
    if record not in os.environ:
        os.environ[record] = os.environ.get(name, "")
    return os.environ[record]


# Before torch is imported; the worker processes tests start inherit it (an explicit
# OMP_NUM_THREADS wins). A worker's status port, unless a test names one: this process's own,
# not the default 9400 (nor the first process's choice) that the xdist process beside it would
# contend for.
os.environ["OMP_NUM_THREADS"] = _users_own("OMP_NUM_THREADS") or str(_threads_per_process())

import torch  # noqa: E402

from tests.ports import free_port  # noqa: E402
from tests.redis_cluster import ClusterServers, start_cluster  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ["TIDEGATE_METRICS_PORT"] = _users_own("TIDEGATE_METRICS_PORT") or str(free_port())

# Every Python process a test starts imports the installed (editable) tidegate, never a folder
# of the repository root by way of its working directory (``kernels/`` would hide Hugging Face's
# ``kernels`` package): the interpreter adds no unsafe path (Python >= 3.11).
os.environ["PYTHONSAFEPATH"] = "1"

# Without a GPU, Triton kernels run in Triton's interpreter (set before Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with ``int(ndarray)``;
    its scalars are 1-element arrays, which NumPy >= 2.4 refuses to convert. Read the element.
    """
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor

    def patch_index_too(tensor: type, scope: object) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__",  # type: ignore[attr-defined]
                       lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_index_too


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_loop_bounds()


# A directory for this pytest run, shared by its xdist processes: tests/worker/hf_oracle.py
# converts the default GGUF for transformers there once instead of once in each process (~15 s
# of CPU each). The process that starts the run makes it before pytest-xdist starts the others,
# which inherit the environment, and removes it at the end: every run converts afresh, so a
# changed GGUF or transformers never meets an earlier run's copy.
SHARED_DIR_ENV = "TIDEGATE_TEST_SHARED_DIR"  # read by tests/worker/hf_oracle.py
_SHARED_DIR = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's own process, not an xdist one
        shared = Path(tempfile.mkdtemp(prefix="tidegate-tests-"))
        config.stash[_SHARED_DIR] = shared
        os.environ[SHARED_DIR_ENV] = str(shared)


def pytest_unconfigure(config: pytest.Config) -> None:
    # After the xdist processes have exited (they end with the session, before this hook).
    shared = config.stash.get(_SHARED_DIR, None)
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)


@dataclass
class RedisServer:
    """A redis-server process the tests own: they may stop and restart it (AOF keeps data)."""

    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: apt-get install -y redis-server")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir),
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        client = redis.Redis(port=self.port)
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    client.close()
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (AOF with fsync always keeps every write)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def flush(self) -> None:
        """Empty every database: a stack started now sees no job an earlier test left queued."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        client = redis.Redis(port=self.port)
        client.flushall()
        client.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(port=free_port(), workdir=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database on the shared server for each test."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis.Redis(port=redis_server.port)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


# A real Redis Cluster (tests/redis_cluster.py): six nodes, one per session, since joining
# them and syncing the replicas takes seconds.
@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServers]:
    """Skipped only when redis-server or redis-cli is not installed."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: ClusterServers) -> str:
    """The shared cluster, whole again (killed nodes restarted) and empty, for each test."""
    redis_cluster.flush()
    return redis_cluster.url
