"""The worker process: intake -> engine -> publisher, with the queue's guarantees around it.

The engine never waits for Redis. The main loop only applies stops, admits prepared jobs and
runs engine steps (in a thread: torch releases the GIL); beside it run tasks for everything
that talks to Redis: the intake (reading, reclaiming, claiming and tokenizing jobs while a
step computes), the publisher's writer (a step's events are written while the next step runs),
the cancel listener, heartbeats and visibility refreshes.

* Pull only what fits: jobs are read only while nothing waits inside the engine and seats are
  free, so a busy worker never hoards jobs another could run.
* Deadlines: an expired job is never started (``rejected: deadline_exceeded``); a running job
  that reaches its deadline stops with ``finish_reason: deadline``, keeping its text.
* Load shedding: a job this worker cannot finish in time is rejected at once
  (``rejected: cannot_meet_deadline``, ``worker.load_shedder``).
* Cancellation: pushed by the API (``worker.cancel_listener``), applied at the next step.
* At-least-once: a job is acked in the same script that stores its result. The worker
  refreshes its in-flight entries; entries other workers left idle past the visibility timeout
  are reclaimed and run again after a ``restarted`` event; after ``max_deliveries`` they go to
  the dead-letter stream.
* Redis outage: the writer retries its batch unchanged and the engine pauses until it lands.
* Drain: SIGTERM stops intake, lets running jobs finish within a grace period, then hands the
  rest back (marked idle, so another worker reclaims them at once) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError, ResponseError

from tidegate import keys
from tidegate.event_log import last_event_id
from tidegate.jobstore import claim_many
from tidegate.protocol import Job, SamplingParams, now_ms
from tidegate.redis_conn import connect
from tidegate.settings import Settings
from tidegate.status_server import StatusServer
from worker.cancel_listener import CancelListener
from worker.cpu_tuning import keep_large_allocations
from worker.engine import Engine, EngineConfig, EngineRequest, RequestError, RequestOutput
from worker.intake import Delivery, StreamIntake
from worker.load_shedder import Commitments, Estimate, Load, LoadShedder, ShedderConfig
from worker.metrics import WorkerMetrics
from worker.publisher import ActiveJob, EventPublisher

log = logging.getLogger("tidegate.worker")

IDLE_BLOCK_MS = 1000
BUSY_BLOCK_MS = 100  # a busy worker's intake waits this long for jobs, then looks again
HEARTBEAT_EVERY_S = 5.0
PEEK_EVERY_S = 0.1
PEEK_COUNT = 16
PROMPT_LEN_CACHE = 1024
EARLY_CANCEL_KEEP_S = 60.0
FINAL_STATUSES = frozenset({"done", "error", "rejected"})


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    visibility_timeout_ms: int = keys.VISIBILITY_TIMEOUT_MS
    max_deliveries: int = keys.MAX_DELIVERIES
    drain_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Arrival:
    """A job the intake claimed and tokenized, for the main loop to admit at a step boundary."""

    delivery: Delivery
    job: Job
    next_event_id: int
    restarted: bool
    prompt_ids: list[int]
    problem: str = ""  # the tokenizer or chat template refused it: answered invalid_request


class WorkerService:
    def __init__(
        self, redis: aioredis.Redis, engine: Engine, *, worker_id: str | None = None,
        partitions: int = 1, ttl_s: int = keys.JOB_TTL_S, policy: QueuePolicy | None = None,
        shedder: LoadShedder | None = None, metrics: WorkerMetrics | None = None,
        status: StatusServer | None = None, stream_interval_s: float = 0.0,
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.metrics = metrics or WorkerMetrics(engine)
        self.status = status
        self.tokenizer = engine.tokenizer
        self.worker_id = worker_id or new_worker_id()
        self.policy = policy or QueuePolicy()
        self.shedder = shedder or LoadShedder()
        self.intake = StreamIntake(redis, self.worker_id, partitions=partitions)
        self.publisher = EventPublisher(redis, self.worker_id, ttl_s=ttl_s, metrics=self.metrics,
                                        interval_s=stream_interval_s,
                                        on_finished=self._finished)
        self.cancels = CancelListener(redis, self._held_job_ids)
        self.active: dict[str, ActiveJob] = {}
        self._arrivals: list[Arrival] = []
        self._work = asyncio.Event()  # arrivals, or a stop, for an idle main loop
        self._boundary = asyncio.Event()  # a step ended: seats may have freed
        self._load: Load | None = None  # the engine's load for the intake (it runs mid-step)
        self._load_at = 0.0
        self._next_deadline_ms = 0
        self._early_cancels: dict[str, float] = {}  # cancels of jobs not admitted yet
        self._intake_ok = True
        self._drain_until: float | None = None
        self._last_reclaim = 0.0
        self._last_peek = 0.0
        self._prompt_lens: OrderedDict[str, int] = OrderedDict()  # job id -> prompt tokens

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Begin a graceful drain (a second call ends it now)."""
        now = time.monotonic()
        if self.status is not None:
            self.status.draining = True
        if self._drain_until is None:
            self._drain_until = now + self.policy.drain_timeout_s
            log.info("draining: no new jobs; %d running", len(self.active))
        else:
            self._drain_until = now
        self._work.set()

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    async def run(self) -> None:
        await self._until_redis(self.intake.ensure_groups)
        self.publisher.start()
        self.cancels.start()
        background = [asyncio.create_task(self._heartbeat()),
                      asyncio.create_task(self._keepalive())]
        try:
            # Jobs are claimed only once cancel requests can reach this worker.
            while not self.cancels.ready.is_set() and not self.draining:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.cancels.ready.wait()
            background.append(asyncio.create_task(self._intake_loop(), name="intake"))
            log.info("worker %s ready on %d streams", self.worker_id, len(self.intake.streams))
            while not self._drained():
                await self._iteration()
            await self._hand_back()
        finally:
            for task in background:
                task.cancel()
            await asyncio.wait(background, timeout=5)
            await self.publisher.stop()
            await self.cancels.stop()
            try:
                await self.redis.delete(keys.worker_heartbeat(self.worker_id))
            except RedisError:
                pass

    def _drained(self) -> bool:
        if self._drain_until is None:
            return False
        idle = not self.engine.has_unfinished() and not self._arrivals
        return idle or time.monotonic() >= self._drain_until

    async def _until_redis(self, action) -> None:  # noqa: ANN001
        while True:
            try:
                return await action()
            except RedisError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def _iteration(self) -> None:
        if self.publisher.stalled:  # Redis is down: hold the engine until the writes land
            self._report_redis()
            await asyncio.sleep(0.05)
            return
        self._report_redis()
        self._stop_jobs()
        self._admit_arrivals()
        if self.engine.has_unfinished():
            outputs = await asyncio.to_thread(timed_step, self.engine, self.shedder)
            self.publisher.record(outputs, self.active)
            self._step_ended()
        else:
            self._work.clear()
            if not self._arrivals and not self.draining:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._work.wait()

    def _step_ended(self) -> None:
        full = self.engine.num_active >= self.engine.config.max_num_seqs
        if (full or self.engine.num_waiting) and time.monotonic() - self._load_at > PEEK_EVERY_S:
            self._load, self._load_at = self._admission_load(), time.monotonic()
        self._boundary.set()

    def _finished(self, job: ActiveJob) -> None:
        """The publisher stored the job's result and acked it."""
        self.active.pop(job.job.id, None)

    def _held_job_ids(self) -> list[str]:
        return [*self.active, *(a.job.id for a in self._arrivals)]

    def _held_deliveries(self) -> list[Delivery]:
        return [job.delivery for job in self.active.values()] + [
            a.delivery for a in self._arrivals]

    def _report_redis(self) -> None:
        if self.status is not None:
            self.status.redis_ok = not self.publisher.stalled and self._intake_ok

    async def _hand_back(self) -> None:
        """On drain timeout: abandon unfinished jobs as if long idle, for others to reclaim."""
        try:
            async with asyncio.timeout(10):
                await self.publisher.flush()
        except TimeoutError:  # their results are lost with us: they will run again
            log.warning("could not store %d results before exit", self.publisher.unwritten)
        left = [job.delivery for job in self.active.values() if job.end is None]
        left += [a.delivery for a in self._arrivals]
        if left:
            log.info("drain: handing %d unfinished jobs back to the group", len(left))
            try:
                await self.intake.release(left, idle_ms=self.policy.visibility_timeout_ms)
            except RedisError as exc:  # they are reclaimed once the visibility timeout passes
                log.warning("could not hand jobs back: %s", exc)

    # ------------------------------------------------------------------ at step boundaries

    def _stop_jobs(self) -> None:
        """Deadlines and cancel requests: abort at this boundary."""
        now = now_ms()
        if self.active and now >= self._next_deadline_ms:
            upcoming = []
            for job_id, job in self.active.items():
                if job.end is not None:
                    continue
                if job.job.deadline_ms <= now:
                    self.engine.abort(job_id, "deadline")
                else:
                    upcoming.append(job.job.deadline_ms)
            self._next_deadline_ms = min(upcoming, default=now + 1000)
        cancels = self.cancels.take()
        if cancels or self._early_cancels:
            t = time.monotonic()
            for job_id in cancels:
                if job_id in self.active:
                    self.engine.abort(job_id, "cancelled")
                else:  # claimed, not admitted yet (or not ours): remembered for a while
                    self._early_cancels[job_id] = t
            for job_id, at in list(self._early_cancels.items()):
                if t - at > EARLY_CANCEL_KEEP_S:
                    del self._early_cancels[job_id]

    def _admit_arrivals(self) -> None:
        """Start the jobs the intake prepared, or answer them (refusals go out with the next
        write). Engine state is read here, where no step is running."""
        if not self._arrivals:
            return
        arrivals, self._arrivals = self._arrivals, []
        load = self._admission_load()
        left = self.engine.tokens_left()
        now = now_ms()
        commitments = Commitments((left.get(job_id, 0), (job.job.deadline_ms - now) / 1000)
                                  for job_id, job in self.active.items() if job.end is None)
        for arrival in arrivals:
            load = self._admit(arrival, load, commitments, now)

    def _admit(self, arrival: Arrival, load: Load, commitments: Commitments, now: int) -> Load:
        job, delivery, next_id = arrival.job, arrival.delivery, arrival.next_event_id
        publisher = self.publisher
        if job.id in self.active:  # the same job delivered twice: the running copy wins
            publisher.ack_only(delivery)
            return load
        if self._early_cancels.pop(job.id, None) is not None:
            publisher.cancelled_before_start(delivery, next_id)
            return load
        if arrival.problem:
            publisher.fail(delivery, next_id, code="invalid_request", message=arrival.problem)
            return load
        request = EngineRequest(job.id, arrival.prompt_ids, job.sampling, lane=job.lane,
                                priority=job.priority, deadline_ms=job.deadline_ms)
        try:
            self.engine.check_request(request)
        except RequestError as exc:
            publisher.fail(delivery, next_id, code="invalid_request", message=str(exc))
            return load
        n_prompt = len(arrival.prompt_ids)
        time_left = (job.deadline_ms - now) / 1000
        estimate = self.shedder.estimate(n_prompt, job.sampling.max_tokens, load, time_left,
                                         commitments)
        if not estimate.admit:
            publisher.fail(delivery, next_id, code="cannot_meet_deadline", rejected=True,
                           message=f"estimated to finish in {estimate.finish_s:.1f}s, "
                                   f"after its deadline")
            return load
        active = ActiveJob(job, delivery, next_id, n_prompt, now_ms(),
                           restart_attempt=max(delivery.attempt, 2) if arrival.restarted else None)
        self.active[job.id] = active
        self.engine.add_request(request)
        publisher.announce(active)
        commitments.add(job.sampling.max_tokens, time_left)
        self._next_deadline_ms = min(self._next_deadline_ms, job.deadline_ms)
        return Load(load.batch_size + 1, load.prefill_tokens_ahead + n_prompt, load.max_num_seqs,
                    load.seat_wait_s)

    def _admission_load(self) -> Load:
        engine, full = self.engine, self.engine.config.max_num_seqs
        seat_wait = 0.0
        if engine.num_active >= full:
            left = engine.tokens_left()
            if left:
                seat_wait = min(left.values()) * self.shedder.step_s(full)
        return Load(engine.num_active, engine.pending_prefill_tokens, full, seat_wait)

    # ------------------------------------------------------------------ intake (beside steps)

    async def _intake_loop(self) -> None:
        while not self.draining:
            try:
                await self._intake_once()
                self._intake_ok = True
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # Redis came back without our streams (no persistence): set them up again.
                log.warning("consumer group missing; recreating it")
                await self._until_redis(self.intake.ensure_groups)
            except RedisError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                self._intake_ok = False
                await asyncio.sleep(0.5)

    async def _intake_once(self) -> None:
        engine = self.engine
        seats = engine.config.max_num_seqs - engine.num_active - len(self._arrivals)
        if engine.num_waiting or seats <= 0:
            # Full: leave runnable jobs to other workers, but answer hopeless ones at once.
            await self._reject_hopeless_head()
            await self._next_boundary(PEEK_EVERY_S)
            return
        deliveries: list[Delivery] = []
        now = time.monotonic()
        if now - self._last_reclaim > self.policy.visibility_timeout_ms / 4000:
            self._last_reclaim = now
            deliveries = await self.intake.reclaim(
                seats, min_idle_ms=self.policy.visibility_timeout_ms)
        if len(deliveries) < seats:
            busy = engine.has_unfinished() or bool(deliveries or self._arrivals)
            deliveries += await self.intake.read(
                seats - len(deliveries), block_ms=BUSY_BLOCK_MS if busy else IDLE_BLOCK_MS)
        if deliveries:
            await self._prepare(deliveries)

    async def _next_boundary(self, timeout_s: float) -> None:
        self._boundary.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._boundary.wait()

    async def _prepare(self, deliveries: list[Delivery]) -> None:
        """Claim the jobs (one round trip), answer those that will not run, tokenize the rest
        and hand them to the main loop."""
        held = set(self._held_job_ids())
        claimable: list[Delivery] = []
        duplicates: list[Delivery] = []
        mine = {(d.stream, d.message_id) for d in self._held_deliveries()}
        for delivery in deliveries:
            job = delivery.job
            if job is None:
                await self._malformed(delivery)
            elif (delivery.stream, delivery.message_id) in mine:
                continue  # our own entry, reclaimed after an outage let it idle: still ours
            elif job.id in held:  # the same job delivered twice: the running copy wins
                duplicates.append(delivery)
            elif delivery.attempt > self.policy.max_deliveries:
                await self._dead_letter(delivery, job)
            else:
                held.add(job.id)
                claimable.append(delivery)
        if duplicates:
            await self.intake.ack(duplicates)
        claims = await claim_many(self.redis, [d.job.id for d in claimable if d.job],
                                  self.worker_id)
        done: list[Delivery] = []
        now = now_ms()
        for delivery, claim in zip(claimable, claims, strict=True):
            job = delivery.job
            assert job is not None
            if claim.before in FINAL_STATUSES:  # cancelled while queued, or finished elsewhere
                done.append(delivery)
            elif claim.before == "cancel_requested":
                self.publisher.cancelled_before_start(delivery, claim.next_event_id)
            elif job.deadline_ms <= now:
                self.publisher.fail(delivery, claim.next_event_id, code="deadline_exceeded",
                                    rejected=True,
                                    message="the deadline passed before a worker could start")
            else:
                self._arrivals.append(self._tokenized(delivery, job, claim.next_event_id,
                                                      restarted=claim.before == "running"
                                                      or delivery.attempt > 1))
        if done:
            await self.intake.ack(done)
        self._work.set()

    def _tokenized(self, delivery: Delivery, job: Job, next_id: int, *,
                   restarted: bool) -> Arrival:
        try:
            prompt_ids = self.tokenizer.encode_prompt(job.prompt, job.messages)
        except ValueError as exc:  # a chat template refusing the messages
            return Arrival(delivery, job, next_id, restarted, [], str(exc))
        return Arrival(delivery, job, next_id, restarted, prompt_ids)

    async def _malformed(self, delivery: Delivery) -> None:
        log.warning("malformed job %s on %s: %s", delivery.message_id, delivery.stream,
                    delivery.problem)
        next_id = await last_event_id(self.redis, delivery.job_id) + 1 if delivery.job_id else 0
        self.publisher.fail(delivery, next_id, code="invalid_job", message=delivery.problem)

    async def _dead_letter(self, delivery: Delivery, job: Job) -> None:
        """Move a job that keeps failing to the lane's dead-letter stream and end it."""
        last_error = (f"its worker stopped responding on each of {delivery.attempt - 1} "
                      f"deliveries")
        await self.redis.xadd(keys.dead_letter_stream(job.lane), {
            "job": job.model_dump_json(), "job_id": job.id, "attempts": str(delivery.attempt),
            "error": last_error, "stream": delivery.stream, "message_id": delivery.message_id,
        }, maxlen=keys.LANE_MAXLEN, approximate=True)
        self.publisher.fail(delivery, await last_event_id(self.redis, job.id) + 1,
                            code="dead_lettered",
                            message=f"gave up after {delivery.attempt - 1} attempts: {last_error}")

    async def _reject_hopeless_head(self) -> None:
        """Take the leading run of undelivered jobs that could not finish in time even once
        this worker's first seat frees; the main loop rejects them now rather than when a
        seat frees."""
        load = self._load
        if not self.shedder.config.enabled or load is None:
            return
        if time.monotonic() - self._last_peek < PEEK_EVERY_S:
            return
        self._last_peek = time.monotonic()
        for stream in self.intake.streams:
            hopeless = 0
            for entry in await self.intake.peek(stream, PEEK_COUNT):
                job = entry.job
                if job is None or self._estimate(job, self._prompt_len(job), load).admit:
                    break
                hopeless += 1
            if hopeless:
                # Another worker may have taken some meanwhile; the main loop judges each again.
                await self._prepare(await self.intake.read_from(stream, hopeless))

    def _estimate(self, job: Job, prompt_tokens: int, load: Load) -> Estimate:
        time_left = (job.deadline_ms - now_ms()) / 1000
        return self.shedder.estimate(prompt_tokens, job.sampling.max_tokens, load, time_left)

    def _prompt_len(self, job: Job) -> int:
        # A full worker peeks at the same waiting jobs every PEEK_EVERY_S: tokenize each once.
        n = self._prompt_lens.get(job.id)
        if n is None:
            try:
                n = len(self.tokenizer.encode_prompt(job.prompt, job.messages))
            except ValueError:
                n = 0  # _admit will answer it with the proper error
            self._prompt_lens[job.id] = n
            if len(self._prompt_lens) > PROMPT_LEN_CACHE:
                self._prompt_lens.popitem(last=False)
        return n

    # ------------------------------------------------------------------ beside everything

    async def _keepalive(self) -> None:
        """Refresh in-flight entries well inside the visibility timeout."""
        while True:
            await asyncio.sleep(self.policy.visibility_timeout_ms / 3000)
            try:
                await self.intake.touch(self._held_deliveries())
            except RedisError as exc:
                log.warning("keepalive failed: %s", exc)

    async def _heartbeat(self) -> None:
        """Keep the worker's key alive, holding its load for ``tidegate.queue_stats``."""
        key = keys.worker_heartbeat(self.worker_id)
        stats = self.engine.stats
        last_t, last_tokens = time.monotonic(), stats.decode_tokens
        while True:
            now, tokens = time.monotonic(), stats.decode_tokens
            rate = (tokens - last_tokens) / max(now - last_t, 1e-3)
            last_t, last_tokens = now, tokens
            beat = {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                    "tokens_per_s": round(rate, 1), "kv_usage": round(self.engine.blocks.usage, 4)}
            try:
                await self.redis.set(key, json.dumps(beat), ex=keys.WORKER_HEARTBEAT_TTL_S)
            except RedisError as exc:  # the main loop sees the outage too; keep beating
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_EVERY_S)


def timed_step(engine: Engine, shedder: LoadShedder) -> list[RequestOutput]:
    """One engine step, timed and reported to the load shedder."""
    stats = engine.stats
    prompt0, decode0 = stats.prompt_tokens_computed, stats.decode_tokens
    t0 = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - t0
    prompt, decodes = stats.prompt_tokens_computed - prompt0, stats.decode_tokens - decode0
    shedder.observe_step(prompt, decodes, seconds)
    log.debug("step: %d prompt tokens, %d decodes, %.1f ms", prompt, decodes, 1000 * seconds)
    return outputs


def calibrate(engine: Engine, shedder: LoadShedder) -> None:
    """Measure the rates the shedder starts from, on throwaway requests: one unmeasured round
    to warm the kernels and allocator up, then a 256-token prompt and decode steps at batch 1
    and at ``max_num_seqs``. The engine's counters are zeroed after: the metrics count jobs."""
    vocab = engine.tokenizer.vocab_size
    full = engine.config.max_num_seqs

    def prompt(i: int, n: int) -> list[int]:
        # Distinct prompts, so the prefix cache can't skip the work being measured.
        return [(7919 * (i * n + j) + i) % (vocab - 1) + 1 for j in range(n)]

    def run(batch: int, prompt_len: int, decodes: int, measure: bool) -> None:
        params = SamplingParams(max_tokens=decodes + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request(EngineRequest(f"calibrate-{measure}-{batch}-{i}",
                                             prompt(i, prompt_len), params))
        while engine.has_unfinished():
            if measure:
                timed_step(engine, shedder)
            else:
                engine.step()

    run(full, 32, 2, measure=False)
    for batch, prompt_len in ((1, 256), (full, 8)):
        run(batch, prompt_len, 8, measure=True)
    engine.reset_stats()
    log.info("calibrated: prefill %.0f tok/s, decode step %.1f ms at batch 1, %.1f ms at %d",
             shedder.prefill_tok_s(), 1000 * shedder.step_s(1), 1000 * shedder.step_s(full), full)


async def serve(settings: Settings) -> None:
    """Load the model, join the consumer group and run until SIGTERM/SIGINT (then drain)."""
    from worker.loader import load_model

    keep_large_allocations()
    status = None
    if settings.metrics_port:  # up first: probes get answers while the model loads
        status = StatusServer(settings.host, settings.metrics_port)
        if not status.start():
            status = None
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
    loaded = load_model(settings.model, device=settings.device, dtype=dtype)
    log.info("loaded %s in %.1fs (%s, %s)", loaded.source.name, loaded.load_s, settings.device,
             next(loaded.model.parameters()).dtype)
    max_len = min(loaded.tokenizer.max_context, loaded.config.max_position_embeddings)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=max_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
        block_size=settings.block_size,
        kv_cache_gb=settings.kv_cache_gb,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
        prefix_caching=settings.prefix_caching,
        cuda_graphs=settings.cuda_graphs,
    ))
    print(f"tidegate worker: {engine.kv_spec.describe()}", flush=True)
    shedder = LoadShedder(ShedderConfig(enabled=settings.load_shedding,
                                        safety=settings.shedding_safety))
    calibrate(engine, shedder)
    redis = connect(settings.redis_url, blocking_ms=IDLE_BLOCK_MS)
    metrics = WorkerMetrics(engine)
    service = WorkerService(
        redis, engine, partitions=settings.lane_partitions, ttl_s=settings.job_ttl_s,
        policy=QueuePolicy(int(settings.visibility_timeout_s * 1000), settings.max_deliveries,
                           settings.drain_timeout_s),
        shedder=shedder, metrics=metrics, status=status,
        stream_interval_s=settings.stream_interval_ms / 1000,
    )
    if status is not None:
        status.registry = metrics.registry
        status.model_loaded = True
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    try:
        await service.run()
    finally:
        await redis.aclose()
        if status is not None:
            status.stop()
