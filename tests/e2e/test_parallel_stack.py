"""Tensor-parallel workers through real processes, as an operator runs them: `tidegate api` and
`tidegate worker --model random:tiny --tensor-parallel-size 2` (rank 0 is the worker process,
rank 1 its spawned child, gloo on the CPU) on a real redis-server.

A parallel worker serves jobs with the tokens a single-process worker gives; a SIGTERM drains its
running job and stops every rank; a killed rank takes the whole worker down (exit status 3, no
rank left behind) and its job is reclaimed by another worker, never lost; a killed rank 0 takes
its ranks with it; every rank starts with NVLink multicast off; and the CLI refuses, in one line,
the parallel workers it cannot start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import torch

from tests.conftest import RedisServer, free_port
from tests.stack_process import TIDEGATE, children, cli, heartbeat_of, is_alive, stop, wait_until
from tidegate.events.event_feed import stored_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "random:tiny"
TP = ("--tensor-parallel-size", "2")
RANK_LOST_EXIT = 3  # tidegate.worker.parallel.rank_processes.RANK_LOST_EXIT, as an operator sees it
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
# Two cores: one torch thread a process, a small KV cache, generous start-up time.
STARTUP_S = 120
WORKER_ENV = {"TIDEGATE_LOG_LEVEL": "INFO", "TIDEGATE_METRICS_PORT": "0",
              "TIDEGATE_KV_CACHE_GB": "0.1", "TIDEGATE_TORCH_THREADS": "1",
              "PYTHONUNBUFFERED": "1"}

# Greedy jobs, and one seeded sample: each compared token by token with a single-process worker.
JOBS = [
    {"prompt": "hello there", "max_tokens": 24, "temperature": 0},
    {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 32,
     "temperature": 0},
    {"prompt": "Count: one, two, three,", "max_tokens": 16, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 11},
]


# ---------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A `tidegate` process, its output in a file (read when a test fails or checks a log)."""

    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def assert_running(self) -> None:
        assert self.popen.poll() is None, (
            f"exited with {self.popen.returncode}:\n{self.output()[-4000:]}")


def start(log: Path, *args: str, url: str, **env: str) -> Proc:
    """``tidegate ARGS`` on ``url``; the NVLink-multicast variables taken out of its
    environment, so that what its ranks hold is the worker's own doing."""
    base = {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF}
    with log.open("wb") as out:
        popen = subprocess.Popen([*TIDEGATE, *args],
                                 env={**base, "TIDEGATE_REDIS_URL": url, **WORKER_ENV, **env},
                                 stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen, log)


def start_worker(tmp: Path, name: str, *args: str, url: str, **env: str) -> tuple[Proc, str]:
    """A worker serving MODEL, once it heartbeats: (process, worker id)."""
    proc = start(tmp / f"{name}.log", "worker", "--model", MODEL, *args, url=url, **env)
    try:
        wait_until(lambda: heartbeat_of(url, proc.pid) or proc.popen.poll() is not None,
                   f"worker {name} to heartbeat")
        proc.assert_running()
    except BaseException:
        stop(proc.popen)
        raise
    worker_id = heartbeat_of(url, proc.pid)
    assert worker_id is not None
    return proc, worker_id


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rank_children(worker: int) -> list[int]:
    """The spawned ranks of process ``worker`` (not multiprocessing's resource tracker)."""
    return [c for c in children(worker) if "spawn_main" in cmdline(c)]


def the_rank(worker: int) -> int:
    """The one child rank of a TP=2 worker."""
    wait_until(lambda: rank_children(worker), "the worker's rank 1 process", 30)
    [rank] = rank_children(worker)
    return rank


def assert_all_gone(pids: list[int], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"{what}: {[(p, cmdline(p)) for p in alive]} still running"


# ---------------------------------------------------------------------------- jobs


async def submit(http: httpx.AsyncClient, body: dict) -> str:
    r = await http.post("/v1/jobs", json={"ignore_eos": True, "timeout_s": 600, **body})
    assert r.status_code == 202, r.text
    return r.json()["id"]


async def result_of(http: httpx.AsyncClient, job_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (result := (await http.get(f"/v1/jobs/{job_id}")).json())["status"] in (
            "queued", "running"):
        assert time.monotonic() < deadline, result
        await asyncio.sleep(0.1)
    return result


async def events_of(url: str, job_id: str) -> list[dict]:
    r = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return [e.data() for e in await stored_events(r, job_id)]
    finally:
        await r.aclose()


def generated(events: list[dict]) -> list[int]:
    return [t for e in events if e["type"] == "token" for t in e["token_ids"]]


async def run_jobs(base: str, url: str) -> list[tuple[list[int], str, str]]:
    """JOBS one at a time (a batch of one, so no batch-dependent rounding): each job's
    generated token ids, text and the worker that started it."""
    outcomes = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for body in JOBS:
            job_id = await submit(http, body)
            result = await result_of(http, job_id)
            assert result["status"] == "done", result
            assert result["usage"]["completion_tokens"] == body["max_tokens"], result
            events = await events_of(url, job_id)
            [started] = [e["worker"] for e in events if e["type"] == "started"]
            text = "".join(e["text"] for e in events if e["type"] == "token")
            assert text == result["text"]
            outcomes.append((generated(events), result["text"], started))
    return outcomes


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parallel-logs")


@pytest.fixture(scope="module")
def api(redis_server: RedisServer, logs: Path) -> Iterator[tuple[str, str]]:
    """`tidegate api` serving MODEL (workers come and go per test): (base URL, Redis URL)."""
    redis_server.flush()
    port = free_port()
    proc = start(logs / "api.log", "api", "--model", MODEL, "--port", str(port),
                 url=redis_server.url, TIDEGATE_LOG_LEVEL="WARNING")
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(lambda: ready() or proc.popen.poll() is not None, "the API")
        proc.assert_running()
        yield base, redis_server.url
    finally:
        stop(proc.popen)


@pytest.fixture(scope="module")
def reference(api: tuple[str, str], logs: Path) -> list[tuple[list[int], str, str]]:
    """JOBS on a plain single-process worker, stopped before any parallel worker starts."""
    base, url = api
    worker, worker_id = start_worker(logs, "plain-reference", url=url)
    try:
        outcomes = asyncio.run(run_jobs(base, url))
    finally:
        stop(worker.popen)
    assert worker.popen.returncode == 0, worker.output()[-4000:]
    assert {started for _, _, started in outcomes} == {worker_id}
    return outcomes


@pytest.fixture(scope="module")
def tp_worker(api: tuple[str, str], reference: list, logs: Path) -> Iterator[tuple[Proc, str]]:
    """A TP=2 worker shared by the tests that leave it running (the SIGTERM test stops it)."""
    _, url = api
    worker, worker_id = start_worker(logs, "tp2", *TP, url=url)
    try:
        yield worker, worker_id
    finally:
        stop(worker.popen)


# ---------------------------------------------------------------------------- tests


async def test_a_tp2_worker_serves_the_single_process_tokens(
        api: tuple[str, str], reference: list[tuple[list[int], str, str]],
        tp_worker: tuple[Proc, str]) -> None:
    base, url = api
    worker, worker_id = tp_worker
    worker.assert_running()
    assert len(children(worker.pid)) >= 1 and len(rank_children(worker.pid)) == 1
    outcomes = await run_jobs(base, url)
    assert {started for _, _, started in outcomes} == {worker_id}
    for body, (tokens, text, _), (want_tokens, want_text, _) in zip(
            JOBS, outcomes, reference, strict=True):
        assert tokens == want_tokens, body
        assert text == want_text, body
    assert "ERROR" not in worker.output()


def test_every_rank_starts_with_nvlink_multicast_off(tp_worker: tuple[Proc, str]) -> None:
    worker, _ = tp_worker
    worker.assert_running()
    rank = the_rank(worker.pid)
    env = dict(item.split("=", 1) for item in
               Path(f"/proc/{rank}/environ").read_bytes().decode().split("\0") if "=" in item)
    assert {k: env.get(k) for k in MULTICAST_OFF} == MULTICAST_OFF
    # The worker was started without them: rank 0 set them for its ranks.
    own = Path(f"/proc/{worker.pid}/environ").read_bytes().decode().split("\0")
    assert not [item for item in own if item.split("=", 1)[0] in MULTICAST_OFF]


async def test_sigterm_drains_the_running_job_and_stops_every_rank(
        api: tuple[str, str], tp_worker: tuple[Proc, str]) -> None:
    base, url = api
    worker, worker_id = tp_worker
    worker.assert_running()
    procs = children(worker.pid)  # its rank and multiprocessing's resource tracker
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        job_id = await submit(http, {"prompt": "Drain me", "max_tokens": 200,
                                     "temperature": 0})

        async def running() -> None:
            while len(generated(await events_of(url, job_id))) < 8:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(running(), 60)
        worker.popen.send_signal(signal.SIGTERM)
        result = await result_of(http, job_id)
    assert result["status"] == "done" and result["usage"]["completion_tokens"] == 200, result
    events = await events_of(url, job_id)
    assert [e["worker"] for e in events if e["type"] == "started"] == [worker_id]
    assert worker.popen.wait(60) == 0, worker.output()[-4000:]
    assert_all_gone(procs, 10, "after the worker stopped")
    log = worker.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-4000:]


async def test_a_killed_rank_stops_the_worker_and_another_worker_finishes_its_job(
        api: tuple[str, str], logs: Path) -> None:
    base, url = api
    short = {"TIDEGATE_VISIBILITY_TIMEOUT_S": "3"}
    worker, worker_id = start_worker(logs, "tp2-rank-killed", *TP, url=url, **short)
    try:
        rank = the_rank(worker.pid)
        procs = children(worker.pid)
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            job_id = await submit(http, {"prompt": "A long story:", "max_tokens": 2000,
                                         "temperature": 0})

            async def some_tokens() -> int:
                while (n := len(generated(await events_of(url, job_id)))) < 16:
                    await asyncio.sleep(0.05)
                return n

            await asyncio.wait_for(some_tokens(), 60)
            os.kill(rank, signal.SIGKILL)
            assert (await http.get(f"/v1/jobs/{job_id}")).json()["status"] == "running"
            try:
                code = await asyncio.to_thread(worker.popen.wait, 20)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the worker outlived its killed rank:\n{worker.output()[-4000:]}")
            assert code == RANK_LOST_EXIT, worker.output()[-4000:]
            assert_all_gone(procs, 10, "after the worker's rank was killed")
            log = worker.output()
            assert f"rank 1 (pid {rank}) exited with status {-signal.SIGKILL}" in log, log[-4000:]
            kept = len(generated(await events_of(url, job_id)))
            assert kept < 2000
            assert (await http.get(f"/v1/jobs/{job_id}")).json()["status"] == "running"

            # A plain worker on the same Redis takes the job over once its visibility lapses.
            rescuer, rescuer_id = start_worker(logs, "plain-rescuer", url=url, **short)
            try:
                result = await result_of(http, job_id, timeout_s=STARTUP_S)
            finally:
                stop(rescuer.popen)
    finally:
        stop(worker.popen)
    assert result["status"] == "done", result
    assert result["usage"]["completion_tokens"] == 2000, result
    events = await events_of(url, job_id)
    assert [e["worker"] for e in events if e["type"] == "started"] == [worker_id]
    [migrated] = [e for e in events if e["type"] == "migrated"]
    assert migrated["worker"] == rescuer_id and migrated["attempt"] == 2, migrated
    assert migrated["kept_tokens"] == kept, (migrated, kept)
    assert not [e for e in events if e["type"] in ("restarted", "error", "rejected")]
    assert len(generated(events)) == 2000
    assert "".join(e["text"] for e in events if e["type"] == "token") == result["text"]
    assert rescuer.popen.returncode == 0, rescuer.output()[-4000:]


def test_a_killed_rank_0_takes_its_ranks_with_it(api: tuple[str, str], logs: Path) -> None:
    _, url = api
    worker, _ = start_worker(logs, "tp2-rank0-killed", *TP, url=url)
    try:
        rank = the_rank(worker.pid)
        procs = children(worker.pid)
        assert rank in procs
        worker.popen.send_signal(signal.SIGKILL)
        assert worker.popen.wait(10) == -signal.SIGKILL
        assert_all_gone(procs, 10, "after rank 0 was killed")
    finally:
        stop(worker.popen)


async def test_up_serves_with_a_tp2_worker_and_stops_every_process(
        redis_server: RedisServer, reference: list[tuple[list[int], str, str]],
        logs: Path) -> None:
    """`tidegate up --tensor-parallel-size 2`: its worker's ranks are the grandchildren of
    `up`; a SIGTERM to `up` stops them all."""
    url = f"redis://127.0.0.1:{redis_server.port}/1"  # its own database: no other worker
    port = free_port()
    up = start(logs / "up.log", "up", "--model", MODEL, *TP, "--port", str(port),
               "--redis-url", url, url=url, TIDEGATE_LOG_LEVEL="WARNING")
    try:
        wait_until(lambda: "tidegate is up" in up.output() or up.popen.poll() is not None,
                   "tidegate up")
        up.assert_running()
        [worker] = [c for c in children(up.pid) if "tidegate worker" in cmdline(c)]
        rank = the_rank(worker)
        everything = [*children(up.pid), *children(worker)]
        assert rank in everything
        outcomes = await run_jobs(f"http://127.0.0.1:{port}", url)
        assert {f"-{worker}-" in started for _, _, started in outcomes} == {True}
        assert [(tokens, text) for tokens, text, _ in outcomes] == [
            (tokens, text) for tokens, text, _ in reference]
        up.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(up.popen.wait, 60) == 0, up.output()[-4000:]
        assert_all_gone(everything, 10, "after tidegate up stopped")
    finally:
        stop(up.popen)
    assert "Traceback" not in up.output() and "ERROR" not in up.output(), up.output()[-4000:]


@pytest.mark.parametrize(("args", "reason"), [
    (("--model", "smollm2", *TP), "must divide the model's 9 attention heads"),
    (("--model", MODEL, "--lora", "x=/tmp", *TP), "--lora: LoRA adapters are not served"),
    (("--model", MODEL, "--tensor-parallel-size", "3"),
     "must divide the model's 4 attention heads"),
    (("--model", MODEL, "--pipeline-parallel-size", "3"), "exceeds the model's 2 layers"),
    pytest.param(("--model", MODEL, "--device", "cuda", *TP), "--device cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(),
                                          reason="this machine has CUDA")),
], ids=["heads", "lora", "tp3", "pp3", "no-cuda"])
@pytest.mark.parametrize("command", ["worker", "up"])
def test_cli_refuses_a_parallel_worker_it_cannot_start(
        command: str, args: tuple[str, ...], reason: str) -> None:
    # An unreachable Redis: the refusal comes before anything is started or connected.
    out = cli(command, "--redis-url", f"redis://127.0.0.1:{free_port()}/0", *args)
    assert out.returncode == 2, (out.returncode, out.stderr[-4000:])
    assert reason in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stdout == ""
