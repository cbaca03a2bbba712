"""The worker process: intake -> engine -> publisher, with the queue's guarantees around it.

* Pull only what fits: jobs are read only while nothing waits inside the engine and seats are
  free, so a busy worker never hoards jobs another could run.
* Deadlines: an expired job is never started (``rejected: deadline_exceeded``); a running job
  that reaches its deadline stops with ``finish_reason: deadline``, keeping its text.
* Load shedding: a job this worker cannot finish in time is rejected at once
  (``rejected: cannot_meet_deadline``, ``worker.load_shedder``).
* Cancellation: flags set by ``POST /v1/jobs/{id}/cancel`` are polled every step.
* At-least-once: the worker refreshes its in-flight entries; entries other workers left idle past
  the visibility timeout are reclaimed and run again after a ``restarted`` event; after
  ``max_deliveries`` they go to the dead-letter stream.
* Drain: SIGTERM stops intake, lets running jobs finish within a grace period, then hands the
  rest back (marked idle, so another worker reclaims them at once) and exits.

The engine step runs in a thread (torch releases the GIL) so the event loop keeps serving Redis
while the model computes.
"""

from __future__ import annotations

import asyncio
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
from tidegate.jobstore import cancel_requested, claim_for_run
from tidegate.protocol import Job, SamplingParams, now_ms
from tidegate.redis_conn import connect
from tidegate.settings import Settings
from tidegate.status_server import StatusServer
from worker.cpu_tuning import keep_large_allocations
from worker.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from worker.intake import Delivery, StreamIntake
from worker.load_shedder import Estimate, Load, LoadShedder, ShedderConfig
from worker.metrics import WorkerMetrics
from worker.publisher import ActiveJob, EventPublisher, StepBatch

log = logging.getLogger("tidegate.worker")

IDLE_BLOCK_MS = 1000
HEARTBEAT_EVERY_S = 5.0
CANCEL_POLL_S = 0.05
PEEK_EVERY_S = 0.1
PEEK_COUNT = 16
PROMPT_LEN_CACHE = 1024
FINAL_STATUSES = frozenset({"done", "error", "rejected"})


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    visibility_timeout_ms: int = keys.VISIBILITY_TIMEOUT_MS
    max_deliveries: int = keys.MAX_DELIVERIES
    drain_timeout_s: float = 30.0


class WorkerService:
    def __init__(
        self, redis: aioredis.Redis, engine: Engine, *, worker_id: str | None = None,
        partitions: int = 1, ttl_s: int = keys.JOB_TTL_S, policy: QueuePolicy | None = None,
        shedder: LoadShedder | None = None, metrics: WorkerMetrics | None = None,
        status: StatusServer | None = None,
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
        self.publisher = EventPublisher(redis, self.intake, self.worker_id, ttl_s=ttl_s,
                                        metrics=self.metrics)
        self.active: dict[str, ActiveJob] = {}
        self._unsent: list[StepBatch] = []  # prepared but not yet written (Redis outage)
        self._drain_until: float | None = None
        self._last_cancel_poll = 0.0
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

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    async def run(self) -> None:
        await self.intake.ensure_groups()
        background = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._keepalive())]
        log.info("worker %s ready on %d streams", self.worker_id, len(self.intake.streams))
        try:
            while not self._drained():
                try:
                    await self._iteration()
                    if self.status is not None:
                        self.status.redis_ok = True
                except ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    # Redis came back without our streams (no persistence): set them up again.
                    log.warning("consumer group missing; recreating it")
                    await self.intake.ensure_groups()
                except RedisError as exc:  # Redis restarting: keep the engine, retry the writes
                    log.warning("redis unavailable (%s); retrying", exc)
                    if self.status is not None:
                        self.status.redis_ok = False
                    await asyncio.sleep(0.5)
            await self._hand_back()
        finally:
            for task in background:
                task.cancel()
            try:
                await self.redis.delete(keys.worker_heartbeat(self.worker_id))
            except RedisError:
                pass

    def _drained(self) -> bool:
        if self._drain_until is None:
            return False
        return not self.engine.has_unfinished() or time.monotonic() >= self._drain_until

    async def _iteration(self) -> None:
        await self._send_unsent()
        if not self.draining:
            await self._intake()
        await self._enforce_deadlines_and_cancels()
        if self.engine.has_unfinished():
            outputs = await self._timed_step()
            self._unsent.append(self.publisher.prepare_step(outputs, self.active))
            await self._send_unsent()

    async def _send_unsent(self) -> None:
        while self._unsent:
            batch = self._unsent[0]
            await self.publisher.flush(batch)
            self._unsent.pop(0)
            for job in batch.finished:
                self.active.pop(job.job.id, None)

    async def _timed_step(self) -> list[RequestOutput]:
        return await asyncio.to_thread(timed_step, self.engine, self.shedder)

    async def _hand_back(self) -> None:
        """On drain timeout: abandon unfinished jobs as if long idle, for others to reclaim."""
        try:
            await self._send_unsent()
        except RedisError as exc:  # their results are lost with us: they will run again
            log.warning("could not store finished results before exit: %s", exc)
        left = [job.delivery for job in self.active.values()]
        if left:
            log.info("drain: handing %d unfinished jobs back to the group", len(left))
            await self.intake.release(left, idle_ms=self.policy.visibility_timeout_ms)

    # ------------------------------------------------------------------ intake

    async def _intake(self) -> None:
        seats = self.engine.config.max_num_seqs - self.engine.num_active
        if self.engine.num_waiting or seats <= 0:
            # Full: leave runnable jobs to other workers, but answer hopeless ones at once.
            await self._reject_hopeless_head()
            return
        deliveries: list[Delivery] = []
        now = time.monotonic()
        if now - self._last_reclaim > self.policy.visibility_timeout_ms / 4000:
            self._last_reclaim = now
            deliveries = await self.intake.reclaim(
                seats, min_idle_ms=self.policy.visibility_timeout_ms)
        if len(deliveries) < seats:
            busy = self.engine.has_unfinished() or deliveries
            deliveries += await self.intake.read(seats - len(deliveries),
                                                 block_ms=0 if busy else IDLE_BLOCK_MS)
        for delivery in deliveries:
            await self._admit(delivery)

    async def _admit(self, delivery: Delivery) -> None:
        job = delivery.job
        if job is None:
            log.warning("malformed job %s on %s: %s", delivery.message_id, delivery.stream,
                        delivery.problem)
            await self.publisher.fail(delivery, code="invalid_job", message=delivery.problem)
            return
        if job.id in self.active:  # the same job delivered twice: the running copy wins
            await self.intake.ack([delivery])
            return
        if delivery.attempt > self.policy.max_deliveries:
            await self.publisher.dead_letter(delivery, lane=job.lane, last_error=(
                f"its worker stopped responding on each of {delivery.attempt - 1} deliveries"))
            return
        if job.deadline_ms <= now_ms():
            await self.publisher.fail(delivery, code="deadline_exceeded", rejected=True,
                                      message="the deadline passed before a worker could start")
            return
        before = await claim_for_run(self.redis, job.id, self.worker_id)
        if before in FINAL_STATUSES:  # cancelled while queued, or finished by someone else
            await self.intake.ack([delivery])
            return
        if before == "cancel_requested":
            await self.publisher.cancelled_before_start(delivery)
            return
        await self._start(delivery, restarted=before == "running" or delivery.attempt > 1)

    async def _start(self, delivery: Delivery, *, restarted: bool) -> None:
        job = delivery.job
        assert job is not None
        try:
            prompt_ids = self.tokenizer.encode_prompt(job.prompt, job.messages)
            request = EngineRequest(job.id, prompt_ids, job.sampling, lane=job.lane,
                                    priority=job.priority, deadline_ms=job.deadline_ms)
            self.engine.check_request(request)
        except ValueError as exc:  # RequestError, or a chat template refusing the messages
            await self.publisher.fail(delivery, code="invalid_request", message=str(exc))
            return
        estimate = self._estimate(job, len(prompt_ids), joining_now=True)
        if not estimate.admit:
            await self.publisher.fail(delivery, code="cannot_meet_deadline", rejected=True,
                                      message=f"estimated to finish in {estimate.finish_s:.1f}s, "
                                              f"after its deadline")
            return
        self.active[job.id] = await self.publisher.start(job, delivery, len(prompt_ids),
                                                         restarted=restarted)
        self.engine.add_request(request)

    def _estimate(self, job: Job, prompt_tokens: int, *, joining_now: bool) -> Estimate:
        engine, full = self.engine, self.engine.config.max_num_seqs
        left = engine.tokens_left()
        seat_wait = 0.0
        if engine.num_active >= full and left:
            seat_wait = min(left.values()) * self.shedder.step_s(full)
        load = Load(engine.num_active, engine.pending_prefill_tokens, full, seat_wait)
        now = now_ms()
        time_left = (job.deadline_ms - now) / 1000
        estimate = self.shedder.estimate(prompt_tokens, job.sampling.max_tokens, load, time_left,
                                         self._commitments(now) if joining_now else ())
        log.debug("job %s: estimated %.2fs, %.2fs left, batch %d -> %s", job.id,
                  estimate.finish_s, time_left, load.batch_size,
                  "admit" if estimate.admit else "reject")
        return estimate

    async def _reject_hopeless_head(self) -> None:
        """Take the leading run of undelivered jobs that could not finish in time even once
        this worker's first seat frees, and reject them now rather than when a seat frees."""
        if not self.shedder.config.enabled:
            return
        if time.monotonic() - self._last_peek < PEEK_EVERY_S:
            return
        self._last_peek = time.monotonic()
        for stream in self.intake.streams:
            hopeless = 0
            for entry in await self.intake.peek(stream, PEEK_COUNT):
                job = entry.job
                if job is None or self._estimate(
                        job, self._prompt_len(job), joining_now=False).admit:
                    break
                hopeless += 1
            if hopeless:
                # Another worker may have taken some meanwhile; _admit judges each one again.
                for delivery in await self.intake.read_from(stream, hopeless):
                    await self._admit(delivery)

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

    def _commitments(self, now: int) -> list[tuple[int, float]]:
        """(tokens left to generate, seconds left) of every running job."""
        left = self.engine.tokens_left()
        return [(left.get(job_id, 0), (job.job.deadline_ms - now) / 1000)
                for job_id, job in self.active.items()]

    # ------------------------------------------------------------------ running jobs

    async def _enforce_deadlines_and_cancels(self) -> None:
        if not self.active:
            return
        now = now_ms()
        for job_id, job in self.active.items():
            if job.job.deadline_ms <= now:
                self.engine.abort(job_id, "deadline")
        if time.monotonic() - self._last_cancel_poll >= CANCEL_POLL_S:
            self._last_cancel_poll = time.monotonic()
            for job_id in await cancel_requested(self.redis, list(self.active)):
                self.engine.abort(job_id, "cancelled")

    async def _keepalive(self) -> None:
        """Refresh in-flight entries well inside the visibility timeout."""
        while True:
            await asyncio.sleep(self.policy.visibility_timeout_ms / 3000)
            try:
                await self.intake.touch([job.delivery for job in self.active.values()])
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
    and at ``max_num_seqs``."""
    vocab = engine.tokenizer.vocab_size
    ids = [(7919 * i) % (vocab - 1) + 1 for i in range(512)]
    full = engine.config.max_num_seqs

    def run(batch: int, prompt_len: int, decodes: int, measure: bool) -> None:
        params = SamplingParams(max_tokens=decodes + 1, ignore_eos=True)
        for i in range(batch):
            # Distinct prompts, so the prefix cache can't skip the work being measured.
            prompt = ids[i : i + prompt_len]
            engine.add_request(EngineRequest(f"calibrate-{measure}-{batch}-{i}", prompt, params))
        while engine.has_unfinished():
            if measure:
                timed_step(engine, shedder)
            else:
                engine.step()

    run(full, 32, 2, measure=False)
    for batch, prompt_len in ((1, 256), (full, 8)):
        run(batch, prompt_len, 8, measure=True)
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
