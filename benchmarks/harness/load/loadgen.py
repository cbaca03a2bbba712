"""The load generator: submit each job at its arrival time and follow it as a real client does,
spread over one or more processes (``--client-procs``) so the generator is never the limit.

Each process gets a share of the jobs (the arrival schedule is fixed beforehand), waits for a
common start, then per job: ``POST /v1/jobs`` over a keep-alive pool, and right after the 202 a
WebSocket (``stream_url?token=``) or SSE follower, or nothing until the end for jobs checked by
polling. When all its jobs are final it reports its CPU seconds over its wall time; only once
every process is done measuring does it read back each job's stored result (``GET
/v1/jobs/{id}``) for the exactness checks, so that traffic stays out of the measured window.
Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as EventType
from queue import Empty

from tidegate.benchmarks.harness.load.follow import Trace, follow_sse, follow_ws
from tidegate.benchmarks.harness.load.http import HttpError, Pool

FINAL_STATUSES = frozenset({"done", "error", "rejected"})
POLL_EVERY_S = 0.2
FETCH_TIMEOUT_S = 60.0  # one GET /v1/jobs/{id}, queue for a pool slot included


@dataclass(frozen=True, slots=True)
class Endpoints:
    api_port: int
    gateway_port: int
    api_key: str | None = None
    host: str = "127.0.0.1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class JobSpec:
    index: int
    body: bytes  # the POST /v1/jobs body (unused for a pre-written job)
    input_len: int
    output_len: int
    offset_s: float  # arrival, from the run's start
    follow: str  # "ws" | "sse" | "poll" (result read at the end) | "none" (submit only)
    job_id: str | None = None  # a pre-written job: follow it without submitting
    stream_token: str | None = None
    constrained: bool = False  # it has a response_format: its grammar may end it early


@dataclass(frozen=True, slots=True)
class ClientPlan:
    endpoints: Endpoints
    jobs: tuple[JobSpec, ...]  # in arrival order
    pool_size: int  # keep-alive connections to the API: submits in flight at once
    job_timeout_s: float  # submit to final event, per job


@dataclass(slots=True)
class JobRecord:
    """One job as its client saw it."""

    index: int
    follow: str
    input_len: int
    output_len: int
    t_scheduled: float
    t_sent: float = 0.0  # the submit request was written (its connection was free)
    t_accepted: float | None = None  # its answer arrived
    t_final: float | None = None  # the final event arrived (polled: the server's stamp)
    submit_status: int = 0  # HTTP status of the submit; 0: no answer
    submit_error: str | None = None
    job_id: str | None = None
    stream_url: str | None = None
    stream_token: str | None = None
    trace: Trace | None = None  # followed jobs
    result: dict | None = None  # GET /v1/jobs/{id}, read after the run
    constrained: bool = False  # as its JobSpec


@dataclass(slots=True)
class LoadResult:
    records: list[JobRecord]
    wall_s: float  # start -> every process done measuring
    proc_cpu_s: list[float]  # each generator process over its own window
    proc_wall_s: list[float]
    parent_cpu_s: float  # this process meanwhile (it only waits)
    stack_cpu_s: dict[str, float] = field(default_factory=dict)  # each stack process, same window


class Generator:
    """One process's share of the load."""

    def __init__(self, plan: ClientPlan) -> None:
        self.plan = plan
        ep = plan.endpoints
        self.api = Pool(ep.host, ep.api_port, plan.pool_size, ep.headers)

    async def run(self, t0: float) -> list[JobRecord]:
        tasks = []
        for spec in self.plan.jobs:
            at = t0 + spec.offset_s
            if (delay := at - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.job(spec, at)))
        records = list(await asyncio.gather(*tasks))
        await self.poll_until_final([r for r in records if r.follow == "poll" and r.job_id])
        return records

    async def job(self, spec: JobSpec, at: float) -> JobRecord:
        rec = JobRecord(spec.index, spec.follow, spec.input_len, spec.output_len, at,
                        constrained=spec.constrained)
        try:
            async with asyncio.timeout(self.plan.job_timeout_s):
                if spec.job_id is None:
                    if not await self.submit(spec, rec):
                        return rec
                else:
                    self._prewritten(spec, rec)
                if spec.follow in ("ws", "sse"):
                    rec.trace = Trace()
                    rec.t_final = await self.follow(rec, rec.trace)
        except TimeoutError:
            self._failed(rec, f"no final event within {self.plan.job_timeout_s:.0f} s")
        except Exception as exc:  # one job's surprise must not end the whole run unrecorded
            self._failed(rec, f"client error: {exc!r}")
        return rec

    @staticmethod
    def _failed(rec: JobRecord, why: str) -> None:
        if rec.trace is not None:
            rec.trace.problem(why)
        elif rec.job_id is None:
            rec.submit_error = why

    async def submit(self, spec: JobSpec, rec: JobRecord) -> bool:
        rec.t_sent = time.monotonic()
        try:
            answer = await self.api.request("POST", "/v1/jobs", spec.body)
        except (OSError, HttpError, asyncio.IncompleteReadError) as exc:
            rec.submit_error = f"{type(exc).__name__}: {exc}"
            return False
        rec.t_sent = answer.sent_at  # past the wait for a pool connection
        rec.t_accepted, rec.submit_status = time.monotonic(), answer.status
        if answer.status != 202:
            rec.submit_error = answer.body[:200].decode(errors="replace")
            return False
        body = answer.json()
        rec.job_id, rec.stream_url = body["id"], body["stream_url"]
        rec.stream_token = body.get("stream_token")
        return True

    def _prewritten(self, spec: JobSpec, rec: JobRecord) -> None:
        ep = self.plan.endpoints
        rec.t_sent = rec.t_accepted = time.monotonic()
        rec.submit_status, rec.job_id, rec.stream_token = 202, spec.job_id, spec.stream_token
        rec.stream_url = f"ws://{ep.host}:{ep.gateway_port}/v1/jobs/{spec.job_id}/stream"

    async def follow(self, rec: JobRecord, trace: Trace) -> float | None:
        assert rec.job_id is not None and rec.stream_url is not None
        if rec.follow == "ws":
            return await follow_ws(rec.stream_url, rec.stream_token, trace)
        ep = self.plan.endpoints
        return await follow_sse(ep.host, ep.gateway_port, rec.job_id, rec.stream_token, trace)

    async def poll_until_final(self, records: list[JobRecord]) -> None:
        """Unfollowed jobs, oldest first, until each is final (they finish roughly in order,
        so this costs about one GET per job)."""
        deadline = time.monotonic() + self.plan.job_timeout_s
        for rec in records:
            while (await self.fetch_within(rec, FETCH_TIMEOUT_S) not in FINAL_STATUSES
                   and time.monotonic() < deadline):
                await asyncio.sleep(POLL_EVERY_S)
            if rec.result is not None and (timings := rec.result.get("timings")):
                # The server's stamp of the final event, on this process's monotonic clock.
                final_wall_s = (rec.result["created_ms"] + timings["total_ms"]) / 1000
                rec.t_final = final_wall_s - (time.time() - time.monotonic())

    async def fetch(self, rec: JobRecord) -> str | None:
        """Read the job's stored status and result into ``rec.result``; its status."""
        try:
            answer = await self.api.request("GET", f"/v1/jobs/{rec.job_id}")
        except (OSError, HttpError, asyncio.IncompleteReadError) as exc:
            rec.result = {"status": None, "fetch_error": f"{type(exc).__name__}: {exc}"}
            return None
        rec.result = (answer.json() if answer.status == 200
                      else {"status": None, "fetch_error": f"HTTP {answer.status}"})
        return rec.result.get("status")

    async def fetch_within(self, rec: JobRecord, timeout_s: float) -> str | None:
        try:
            async with asyncio.timeout(timeout_s):
                return await self.fetch(rec)
        except TimeoutError:
            rec.result = {"status": None, "fetch_error": f"no answer within {timeout_s:.0f} s"}
            return None

    async def collect(self, records: list[JobRecord]) -> None:
        """Stored results of the followed jobs, for the exactness checks."""
        followed = [r for r in records if r.trace is not None and r.job_id]
        await asyncio.gather(*(self.fetch_within(r, FETCH_TIMEOUT_S) for r in followed))


# ---------------------------------------------------------------- processes


def raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass(frozen=True, slots=True)
class Signals:
    """What a generator process shares with the benchmark (``multiprocessing`` primitives)."""

    ready: EventType  # set by the process: imported, about to wait for ``go``
    go: EventType  # set by the benchmark once every process is ready; ``start`` is set
    collect: EventType  # every process is done measuring: read the stored results now
    start: Synchronized  # the common start, time.monotonic()
    out: Queue  # ("measured", index, cpu_s, wall_s), then ("records", index, records)


def client_process(index: int, plan: ClientPlan, signals: Signals) -> None:
    """A generator process (spawned): its share of the jobs, results back through ``out``."""
    raise_file_limit()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(_client(index, plan, signals))


async def _client(index: int, plan: ClientPlan, signals: Signals) -> None:
    generator = Generator(plan)
    watchdog = asyncio.create_task(_exit_when_orphaned(os.getppid()))
    signals.ready.set()
    await asyncio.to_thread(signals.go.wait)
    cpu0, wall0 = time.process_time(), time.monotonic()
    records = await generator.run(signals.start.value)
    signals.out.put(("measured", index, time.process_time() - cpu0, time.monotonic() - wall0))
    await asyncio.to_thread(signals.collect.wait)
    await generator.collect(records)
    generator.api.close()
    watchdog.cancel()
    signals.out.put(("records", index, records))


async def _exit_when_orphaned(parent: int) -> None:
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def run_load(plans: list[ClientPlan], sample_cpu: Callable[[], dict[str, float]],
             check_stack: Callable[[], None]) -> LoadResult:
    """Run the plans in one process each, all starting together; the stack's CPU is sampled
    over the same window as the generator's."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process is copied
    out, go, collect, start = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    signals = [Signals(ctx.Event(), go, collect, start, out) for _ in plans]
    procs = [ctx.Process(target=client_process, args=(i, plan, signals[i]), daemon=True)
             for i, plan in enumerate(plans)]
    for p in procs:
        p.start()
    try:
        while not all(s.ready.wait(0.1) for s in signals):
            _check(procs, check_stack)
        cpu0, parent0 = sample_cpu(), time.process_time()
        start.value = time.monotonic() + 0.05
        go.set()
        measured = _gather(out, "measured", procs, check_stack)
        wall = time.monotonic() - start.value
        cpu1, parent1 = sample_cpu(), time.process_time()
        collect.set()
        shards = _gather(out, "records", procs, check_stack)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    records = sorted((r for i in range(len(plans)) for r in shards[i][0]), key=lambda r: r.index)
    return LoadResult(records, wall, [measured[i][0] for i in range(len(plans))],
                      [measured[i][1] for i in range(len(plans))], parent1 - parent0,
                      {k: cpu1[k] - cpu0[k] for k in cpu1 if k in cpu0})


def _gather(out: Queue, kind: str, procs: list[BaseProcess],
            check_stack: Callable[[], None]) -> dict[int, tuple]:
    """One ``kind`` message from every process, by process index."""
    got: dict[int, tuple] = {}
    while len(got) < len(procs):
        try:
            message = out.get(timeout=0.5)
        except Empty:
            _check(procs, check_stack)
            continue
        assert message[0] == kind, message[0]
        got[message[1]] = message[2:]
    return got


def _check(procs: list[BaseProcess], check_stack: Callable[[], None]) -> None:
    for p in procs:
        if p.exitcode not in (None, 0):
            raise RuntimeError(f"a load-generator process exited with {p.exitcode}")
    check_stack()


def shard(jobs: list[JobSpec], procs: int) -> list[tuple[JobSpec, ...]]:
    """Round-robin over the processes, so each gets an even share of every part of the
    schedule."""
    return [tuple(jobs[i::procs]) for i in range(procs) if jobs[i::procs]]
