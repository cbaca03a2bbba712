"""The worker process: intake -> engine -> publisher, with the queue's guarantees around it.

A ``WorkerService`` serves one model (its served name): it reads only that model's lanes and
heartbeats with the model's name and adapters. A process serving several models
(``--model`` repeated, ``--models-file``) runs one service per model, each with its own engine
and worker id, in one event loop behind one status port (``serve``).

The engine never waits for Redis. The main loop only applies stops, admits prepared jobs and
runs engine steps (on the thread that built the engine, ``EngineThread``: torch releases the
GIL); beside it run tasks for everything that talks to Redis: the intake (reading, reclaiming, claiming and tokenizing jobs while a
step computes), the publisher's writer (a step's events are written while the next step runs),
the cancel listener, heartbeats and visibility refreshes.

* Pull only what fits: jobs are read only while nothing waits inside the engine and seats are
  free, so a busy worker never hoards jobs another could run.
* Deadlines: an expired job is never started (``rejected: deadline_exceeded``); a running job
  that reaches its deadline stops with ``finish_reason: deadline``, keeping its text.
* Load shedding: a job this worker cannot finish in time is rejected at once
  (``rejected: cannot_meet_deadline``, ``tidegate.worker.shedding.load_shedder``).
* Cancellation: pushed by the API (``tidegate.worker.service.cancel_listener``), applied at the next step.
* At-least-once: a job is acked in the same script that stores its result. The worker
  refreshes its in-flight entries; entries other workers left idle past the visibility timeout
  are reclaimed and continue from the last stored token after a ``migrated`` event
  (``tidegate.worker.service.migration``; ``restarted`` and a run from the start where that is impossible).
  A job whose workers die ``max_deliveries`` times in a row before storing a token goes to the
  dead-letter stream; deliveries that made progress don't count.
* Redis outage: the writer retries its batch unchanged and the engine pauses until it lands.
* Drain: SIGTERM stops intake, lets running jobs finish within a grace period, then hands the
  rest back (marked idle, so another worker reclaims them at once) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError

from tidegate import keys
from tidegate.cancelling import cancel_and_wait
from tidegate.kernels.gpu.kernel_compiles import Compile, kernel_compiles
from tidegate.model_files.model_source import ModelLoadError, resolve_model
from tidegate.model_files.served_model import ServedModel, served_models
from tidegate.model_files.tokenizer import load_tokenizer
from tidegate.operations.status_server import StatusServer
from tidegate.protocol import Job, SamplingParams, now_ms
from tidegate.redis_conn import connect
from tidegate.retention import Retention
from tidegate.settings import Settings
from tidegate.structured.response_format import GrammarFormat
from tidegate.structured.tool_calls import forced_call_grammar
from tidegate.worker.engine.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    RequestError,
    RequestOutput,
    ResumeError,
)
from tidegate.worker.engine.grammar_masks import GrammarUnavailable
from tidegate.worker.models.decoder import DecoderModel
from tidegate.worker.parallel.layout import ParallelLayout
from tidegate.worker.parallel.parallel_engine import start_parallel_engine
from tidegate.worker.service.adapter_loader import AdapterLoader
from tidegate.worker.service.arrivals import IDLE_BLOCK_MS, Arrival, ArrivalIntake
from tidegate.worker.service.cache_announcer import CacheAnnouncer
from tidegate.worker.service.cancel_listener import CancelListener
from tidegate.worker.service.cpu_tuning import keep_large_allocations
from tidegate.worker.service.engine_thread import EngineThread
from tidegate.worker.service.intake import Delivery, StreamIntake
from tidegate.worker.service.metrics import ProcessMetrics, WorkerMetrics
from tidegate.worker.service.migration import job_seed
from tidegate.worker.service.publisher import ActiveJob, EventPublisher
from tidegate.worker.shedding.calibration import calibrate, timed_step
from tidegate.worker.shedding.load_shedder import Commitments, Load, LoadShedder, ShedderConfig
from tidegate.worker.shedding.step_budget import StepBudget, StepBudgetConfig
from tidegate.worker.speculative.speculative_engine import speculative_engine

if TYPE_CHECKING:
    from tidegate.worker.models.loaders.loader import LoadedModel

log = logging.getLogger("tidegate.worker")

HEARTBEAT_EVERY_S = 5.0
KEEPALIVE_RETRY_S = 0.5
LOAD_EVERY_S = 0.1  # how often a full worker notes its load for the intake's peeks
EARLY_CANCEL_KEEP_S = 60.0


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    visibility_timeout_ms: int = keys.VISIBILITY_TIMEOUT_MS
    max_deliveries: int = keys.MAX_DELIVERIES
    drain_timeout_s: float = 30.0


class WorkerService:
    def __init__(
        self, redis: aioredis.Redis, engine: Engine, *, model: str,
        worker_id: str | None = None, partitions: int = 1, retention: Retention | None = None,
        policy: QueuePolicy | None = None,
        shedder: LoadShedder | None = None, metrics: WorkerMetrics | None = None,
        status: StatusServer | None = None, stream_interval_s: float = 0.0,
        prefix_routing: bool = False, steal_delay_ms: int = 200,
        engine_thread: EngineThread | None = None,
    ) -> None:
        self.redis = redis
        self.engine = engine
        # the thread the engine was built on, if it was (``EngineThread``)
        self.engine_thread = engine_thread or EngineThread()
        self.model = model  # the served name
        self.metrics = metrics or WorkerMetrics(engine)
        self.status = status
        self.tokenizer = engine.tokenizer
        self.worker_id = worker_id or new_worker_id()
        self.policy = policy or QueuePolicy()
        self.shedder = shedder or LoadShedder()
        self.intake = StreamIntake(redis, self.worker_id, model=model, partitions=partitions,
                                   routing=prefix_routing, steal_delay_ms=steal_delay_ms)
        self.metrics.watch_intake(self.intake)
        # Prefix routing: what its cache holds, for the API to route jobs here.
        self.announcer = CacheAnnouncer(
            redis, engine, model=model, worker_id=self.worker_id,
            own_streams=list(self.intake.own),
            busy=lambda: engine.num_active + len(self.arrivals.arrivals),
            finished=lambda: self.jobs_finished) if prefix_routing else None
        self.jobs_finished = 0  # jobs whose results it stored
        self.adapters = AdapterLoader(redis, engine, model=model, worker_id=self.worker_id)
        self.publisher = EventPublisher(redis, self.worker_id, retention=retention,
                                        metrics=self.metrics,
                                        interval_s=stream_interval_s,
                                        on_finished=self._finished, on_lost=self._lost,
                                        tool_format=self.tokenizer.tool_format)
        self.cancels = CancelListener(redis, self._held_job_ids)
        self._work = asyncio.Event()  # arrivals, or a stop, for an idle main loop
        self.arrivals = ArrivalIntake(
            redis, engine, self.intake, self.publisher, self.shedder, worker_id=self.worker_id,
            visibility_timeout_ms=self.policy.visibility_timeout_ms,
            max_deliveries=self.policy.max_deliveries, running=self._running_deliveries,
            wake=self._work, adapters=self.adapters)
        self.active: dict[str, ActiveJob] = {}
        self._load_at = 0.0
        # Bounds over the running jobs: no job's deadline is earlier (the deadline scan is due
        # then), none has more tokens left. Stale ones only bring the scan, or admission's
        # exact check, early.
        self._min_deadline_ms = math.inf
        self._max_tokens_bound = 0
        self._early_cancels: dict[str, float] = {}  # cancels of jobs not admitted yet
        self._drain_until: float | None = None
        self.failed = False  # a task beside the main loop died (``_task_ended``)
        self._to_drop: list[str] = []  # jobs lost to another worker, to abort in the engine

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

    async def load_adapters(self, loras: Mapping[str, str]) -> None:
        """Register and load the model's configured adapters (``--lora``), waiting out a Redis
        outage; ``AdapterLoadError`` if one cannot be served."""
        await self._until_redis(lambda: self.adapters.load_configured(loras))

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    async def run(self) -> int:
        """Serve until drained: 0, or 1 when a task beside the main loop died (logged; the
        jobs are handed back, so another worker continues them)."""
        await self._until_redis(self.intake.ensure_groups)
        await self._until_redis(self.adapters.load_registered)
        self.publisher.start()
        self.cancels.start()
        self.adapters.start()
        background = [asyncio.create_task(self._heartbeat(), name="heartbeat"),
                      asyncio.create_task(self._keepalive(), name="keepalive")]
        if self.announcer is not None:
            self.announcer.note()
            self.announcer.start()
            assert self.announcer.task is not None
            background.append(self.announcer.task)
        for task in [*background, *self.publisher.tasks, *self.cancels.tasks,
                     *self.adapters.tasks]:
            task.add_done_callback(self._task_ended)
        try:
            # Jobs are claimed only once cancel requests can reach this worker.
            while not self.cancels.ready.is_set() and not self.draining:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.cancels.ready.wait()
            intake = asyncio.create_task(self.arrivals.run(lambda: self.draining), name="intake")
            intake.add_done_callback(self._task_ended)
            background.append(intake)
            log.info("worker %s ready on %d streams of %s", self.worker_id,
                     len(self.intake.streams), self.model)
            while not self._drained():
                await self._iteration()
            await self._hand_back()
        finally:
            await cancel_and_wait(*background)
            if self.announcer is not None:
                await self.announcer.stop()
            await self.publisher.stop()
            await self.cancels.stop()
            await self.adapters.stop()
            try:
                await self.redis.delete(keys.worker_heartbeat(self.worker_id))
            except RedisError:
                pass
        return 1 if self.failed else 0

    def _task_ended(self, task: asyncio.Task[object]) -> None:
        """A task beside the main loop ended. Each runs until cancelled (the intake until the
        drain): one that died would leave the worker up but deaf (no jobs read, or none
        written), so the worker stops at once and exits 1 for its supervisor to restart."""
        if task.cancelled() or (self.draining and task.exception() is None):
            return  # stopped, or ended by the drain
        self.failed = True
        log.error("worker task %s died; stopping the worker", task.get_name(),
                  exc_info=task.exception())
        self._drain_until = time.monotonic()
        self._work.set()

    def _drained(self) -> bool:
        if self._drain_until is None:
            return False
        idle = not self.engine.has_unfinished() and not self.arrivals.arrivals
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
            outputs = await self.engine_thread.run(self._step)
            self.publisher.record(outputs, self.active)
            self._step_ended()
        else:
            if self.announcer is not None:
                self.announcer.note(idle=True)
            self._work.clear()
            if not self.arrivals.arrivals and not self.draining:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._work.wait()

    def _step(self) -> list[RequestOutput]:
        """One engine step (on the engine's thread), its wall and CPU time counted."""
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = timed_step(self.engine, self.shedder)
        self.metrics.step_cpu_seconds.inc(time.thread_time() - cpu)
        self.metrics.step_seconds.inc(time.perf_counter() - wall)
        return outputs

    def _step_ended(self) -> None:
        if self.announcer is not None:
            self.announcer.note()
        full = self.engine.num_active >= self.engine.config.max_num_seqs
        if (full or self.engine.num_waiting) and time.monotonic() - self._load_at > LOAD_EVERY_S:
            self.arrivals.load, self._load_at = self._admission_load(), time.monotonic()
        self.arrivals.step_ended()

    def _finished(self, job: ActiveJob) -> None:
        """The publisher stored the job's result and acked it."""
        self.jobs_finished += 1
        self.active.pop(job.job.id, None)
        if not self.active:
            self._min_deadline_ms, self._max_tokens_bound = math.inf, 0

    def _lost(self, job_ids: list[str]) -> None:
        """Another worker owns these jobs now (``EventPublisher._drop``): stop computing them."""
        for job_id in job_ids:
            if self.active.pop(job_id, None) is not None:
                self._to_drop.append(job_id)  # the engine is told at the next boundary
        self._work.set()
        if not self.active:
            self._min_deadline_ms, self._max_tokens_bound = math.inf, 0

    def _held_job_ids(self) -> list[str]:
        return [*self.active, *(a.job.id for a in self.arrivals.arrivals)]

    def _running_deliveries(self) -> list[Delivery]:
        return [job.delivery for job in self.active.values()]

    def _report_redis(self) -> None:
        if self.status is not None:
            self.status.redis_ok = not self.publisher.stalled and self.arrivals.ok

    async def _hand_back(self) -> None:
        """On drain timeout: abandon unfinished jobs as if long idle, for others to reclaim."""
        try:
            async with asyncio.timeout(10):
                await self.publisher.flush()
        except TimeoutError:  # their results are lost with us: they will run again
            log.warning("could not store %d results before exit", self.publisher.unwritten)
        left = [job.delivery for job in self.active.values() if job.end is None]
        left += [a.delivery for a in self.arrivals.arrivals]
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
        if self.active and now >= self._min_deadline_ms:
            upcoming = []
            for job_id, job in self.active.items():
                if job.end is not None:
                    continue
                if job.job.deadline_ms <= now:
                    self.engine.abort(job_id, "deadline")
                else:
                    upcoming.append(job.job.deadline_ms)
            self._min_deadline_ms = min(upcoming, default=math.inf)
        if self._to_drop:
            for job_id in self._to_drop:
                self.engine.abort(job_id, "cancelled")  # its output is dropped: not active
            self._to_drop.clear()
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
        arrivals = self.arrivals.take()
        if not arrivals:
            return
        load = self._admission_load()
        now = now_ms()

        def exact() -> list[tuple[int, float]]:
            left = self.engine.tokens_left()
            return [(left.get(job_id, 0), (job.job.deadline_ms - now) / 1000)
                    for job_id, job in self.active.items() if job.end is None]

        # Bounds kept as jobs come and go: the pass over the batch only when they can't decide.
        commitments = Commitments(bound=(self._max_tokens_bound,
                                         (self._min_deadline_ms - now) / 1000), exact=exact)
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
        try:
            sampling = self._sampling(job)
        except ValueError as exc:
            publisher.fail(delivery, next_id, code="invalid_request", message=str(exc))
            return load
        request = EngineRequest(job.id, arrival.prompt_ids, sampling, lane=job.lane,
                                priority=job.priority, deadline_ms=job.deadline_ms,
                                seed=job_seed(job), adapter=job.adapter)
        kept: int | None = None  # a migrated job: the tokens it continues from
        # A job of several choices starts over (its stored tokens interleave its choices).
        if arrival.resume is not None and job.sampling.n == 1:
            resumed = replace(request, output_ids=arrival.resume.token_ids,
                              output_text=arrival.resume.text)
            try:
                self.engine.check_request(resumed)
                request, kept = resumed, len(resumed.output_ids)
            except ResumeError as exc:
                log.warning("job %s cannot continue (%s): it starts over", job.id, exc)
            except RequestError:
                pass  # answered below, as for any job
        try:
            if kept is None:  # a continued request passed the same checks above
                self.engine.check_request(request)
        except RequestError as exc:
            publisher.fail(delivery, next_id, code="invalid_request", message=str(exc))
            return load
        n_prompt = len(arrival.prompt_ids)
        n_prefix = n_prompt + len(request.output_ids)  # what the prefill computes
        tokens_left = job.sampling.max_tokens - len(request.output_ids)
        time_left = (job.deadline_ms - now) / 1000
        estimate = self.shedder.estimate(n_prefix, tokens_left, load, time_left, commitments)
        if not estimate.admit:
            publisher.fail(delivery, next_id, code="cannot_meet_deadline", rejected=True,
                           message=f"estimated to finish in {estimate.finish_s:.1f}s, "
                                   f"after its deadline")
            return load
        attempt = max(delivery.attempt, 2)
        active = ActiveJob(job, delivery, next_id, n_prompt, now_ms(),
                           restart_attempt=attempt if arrival.taken_over and kept is None
                           else None,
                           migrated=(attempt, kept) if kept is not None else None)
        self.active[job.id] = active
        if arrival.taken_over:
            self.metrics.takeovers.labels(how="migrated" if kept is not None else "restarted").inc()
            self.metrics.migrated_tokens.inc(kept or 0)
        self.engine.add_request(request)
        publisher.announce(active)
        commitments.add(tokens_left, time_left)
        self._min_deadline_ms = min(self._min_deadline_ms, job.deadline_ms)
        self._max_tokens_bound = max(self._max_tokens_bound, job.sampling.max_tokens)
        return Load(load.batch_size + job.sampling.n, load.prefill_tokens_ahead + n_prefix,
                    load.max_num_seqs, load.seat_wait_s)

    def _sampling(self, job: Job) -> SamplingParams:
        """The job's sampling, a forced tool call's grammar in it where the API did not put it
        there (the batch lane enqueues without the API's admission)."""
        if not job.rendered_tools():
            return job.sampling
        fmt = self.tokenizer.tool_format
        if fmt is None:
            raise ValueError("tools: this model's chat template has no tool-call format")
        if not job.forced_tools() or job.sampling.response_format is not None:
            return job.sampling
        grammar = forced_call_grammar(fmt, job.tools or [], job.tool_choice,
                                      job.parallel_tool_calls)
        return job.sampling.model_copy(
            update={"response_format": GrammarFormat(grammar=grammar)})

    def _admission_load(self) -> Load:
        engine, full = self.engine, self.engine.config.max_num_seqs
        seat_wait = 0.0
        if engine.num_active >= full:
            left = engine.tokens_left()
            if left:
                seat_wait = min(left.values()) * self.shedder.step_s(full)
        return Load(engine.num_active, engine.pending_prefill_tokens, full, seat_wait)

    # ------------------------------------------------------------------ beside everything

    async def _keepalive(self) -> None:
        """Refresh in-flight entries well inside the visibility timeout; after a failure
        (Redis out of reach) again every half second, so the entries are fresh the moment
        Redis answers, before another worker could take them as abandoned."""
        every_s = self.policy.visibility_timeout_ms / 3000
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.intake.touch(self.arrivals.held())
                every_s = self.policy.visibility_timeout_ms / 3000
            except RedisError as exc:
                if every_s > KEEPALIVE_RETRY_S:
                    log.warning("keepalive failed: %s", exc)
                every_s = KEEPALIVE_RETRY_S

    def _prefix_hit_rate(self) -> float:
        scheduler = self.engine.scheduler
        queried = scheduler.prefix_query_tokens
        return scheduler.prefix_hit_tokens / queried if queried else 0.0

    async def _heartbeat(self) -> None:
        """Keep the worker's key alive, holding its load for ``tidegate.operations.queue_stats``."""
        key = keys.worker_heartbeat(self.worker_id)
        stats = self.engine.stats
        last_t, last_tokens = time.monotonic(), stats.decode_tokens
        while True:
            now, tokens = time.monotonic(), stats.decode_tokens
            rate = (tokens - last_tokens) / max(now - last_t, 1e-3)
            last_t, last_tokens = now, tokens
            beat = {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                    "tokens_per_s": round(rate, 1), "kv_usage": round(self.engine.blocks.usage, 4),
                    "model": self.model, "adapters": self.engine.adapter_names(),
                    "prefix_hit_rate": round(self._prefix_hit_rate(), 4)}
            try:
                await self.redis.set(key, json.dumps(beat), ex=keys.WORKER_HEARTBEAT_TTL_S)
            except RedisError as exc:  # the main loop sees the outage too; keep beating
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_EVERY_S)


def build_engine(settings: Settings) -> Engine:
    """The model and the engine a worker with these settings runs (benchmarks build the same)."""
    from tidegate.worker.models.loaders.loader import load_model

    keep_large_allocations()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
    packed = {"auto": None, "packed": True, "dequantized": False}[settings.weights]
    layout = ParallelLayout(settings.tensor_parallel_size, settings.pipeline_parallel_size)
    if layout.world > 1:
        return _build_parallel_engine(settings, layout)
    loaded = load_model(settings.model, device=settings.device, dtype=dtype, packed=packed,
                        quantize=settings.quantize, cpu_activations=settings.cpu_activations)
    packed_types = loaded.packed_types()
    log.info("loaded %s in %.1fs (%s, %s, %.1f MB of weights%s)", loaded.source.name,
             loaded.load_s, settings.device, next(loaded.model.parameters()).dtype,
             loaded.weight_bytes() / 1e6,
             f", packed {'+'.join(packed_types)}, {loaded.activations()} activations"
             if packed_types else "")
    max_len = min(loaded.tokenizer.max_context, loaded.config.max_position_embeddings)
    draft = None
    if settings.speculative.startswith("draft:"):
        draft = _load_draft(settings, loaded, dtype)
    engine = speculative_engine(loaded.model, loaded.tokenizer,
                                engine_config(settings, max_len, settings.max_loras), draft=draft)
    _prepare_grammars(engine)
    return engine


def _load_draft(settings: Settings, target: LoadedModel, dtype: torch.dtype | None
                ) -> DecoderModel:
    """The draft model of ``--speculative draft:MODEL``, on the target's device and dtype;
    ``ModelLoadError`` unless it shares the target's tokenizer (the same vocabulary, ids and
    end tokens): its drafts are token ids the target verifies."""
    from tidegate.worker.models.loaders.loader import load_model

    spec = settings.speculative.removeprefix("draft:")
    draft = load_model(spec, device=settings.device, dtype=dtype,
                       cpu_activations=settings.cpu_activations)
    ours, theirs = target.tokenizer, draft.tokenizer
    if (ours.backend.get_vocab(with_added_tokens=True)
            != theirs.backend.get_vocab(with_added_tokens=True)
            or ours.eos_token_ids != theirs.eos_token_ids):
        raise ModelLoadError(f"--speculative {settings.speculative}: the draft's tokenizer is "
                             f"not {target.source.name}'s (a draft must share the target's "
                             "vocabulary)")
    log.info("draft model %s loaded in %.1fs (%.1f MB of weights)", draft.source.name,
             draft.load_s, draft.weight_bytes() / 1e6)
    return draft.model


def engine_config(settings: Settings, max_model_len: int, max_loras: int) -> EngineConfig:
    batch = settings.batch()
    return EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=batch.max_num_seqs,
        max_num_batched_tokens=batch.max_num_batched_tokens,
        block_size=settings.block_size,
        kv_cache_gb=settings.kv_cache_gb,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
        kv_cache_dtype=settings.kv_cache_dtype,
        prefix_caching=settings.prefix_caching,
        cuda_graphs=settings.cuda_graphs,
        max_loras=max_loras,
        max_lora_rank=settings.max_lora_rank,
        speculative=(None if settings.speculative == "none" else
                     "draft" if settings.speculative.startswith("draft:") else
                     settings.speculative),
        num_speculative_tokens=settings.num_speculative_tokens,
        speculative_max_batch=settings.speculative_max_batch,
    )


def pace_steps(engine: Engine, shedder: LoadShedder, settings: Settings) -> None:
    """Bound each step's tokens by the time its decodes may take (``max_step_ms``), from the
    costs ``shedder`` measures; after calibration, which ran with the engine's whole budget."""
    ms = settings.max_step_ms
    if ms > 0:
        engine.scheduler.step_budget = StepBudget(
            StepBudgetConfig(ms / 1000, engine.config.max_num_batched_tokens), shedder)
        log.info("steps that decode aim at %.0f ms: prompt chunks sized to fit", ms)


def _prepare_grammars(engine: Engine) -> None:
    try:  # the grammar engine's token tables now, not on the first constrained job
        engine.grammars.prepare()
    except GrammarUnavailable as exc:
        log.warning("structured outputs unavailable: %s", exc)


def _build_parallel_engine(settings: Settings, layout: ParallelLayout) -> Engine:
    """Rank 0 of a tensor- or pipeline-parallel worker (``tidegate.worker.parallel``); LoRA off."""
    from tidegate.worker.models.loaders.loader import check_layout

    # The other ranks need the engine's config before rank 0 has loaded anything: the
    # context comes from the model's config and tokenizer, read without the weights.
    config = check_layout(settings.model, layout)
    tokenizer = load_tokenizer(resolve_model(settings.model))
    engine = start_parallel_engine(
        settings.model, layout,
        engine_config(settings, min(tokenizer.max_context, config.max_position_embeddings),
                      max_loras=0),
        device=settings.device, dtype=settings.dtype,
        quantize=None if settings.quantize == "none" else settings.quantize,
        torch_threads=settings.torch_threads)
    _prepare_grammars(engine)
    return engine


async def serve(settings: Settings) -> int:
    """Load every served model, join each one's consumer group and run until SIGTERM/SIGINT
    (then drain): one ``WorkerService`` per model in this event loop, one status port."""
    models = served_models(settings)
    status = None
    if settings.metrics_port:  # up first: probes get answers while the models load
        status = StatusServer(settings.host, settings.metrics_port)
        if not status.start():
            status = None
    # The engine's thread takes the GIL back sooner from the event loop's writer and intake
    # (the default switch interval, 5 ms, is a fair share of a decode step).
    sys.setswitchinterval(0.001)
    redis = connect(settings.redis_url, blocking_ms=IDLE_BLOCK_MS)
    base_id = new_worker_id()
    metrics = ProcessMetrics()
    services: list[WorkerService] = []
    # On a GPU the warm-up compiles the Triton kernels; a later compile stalls a step. (A CPU
    # worker does not import Triton for this.)
    compiles = kernel_compiles() if settings.device.startswith("cuda") else None
    try:
        for model in models:
            # One model: the process's id; several: each its own, named after its model.
            worker_id = base_id if len(models) == 1 else f"{base_id}-{model.name}"
            service = await _model_service(settings, model, redis, worker_id, status)
            metrics.add(model.name, service.metrics.registry)
            services.append(service)
        if compiles is not None:
            compiles.warmed_up()
            compiles.on_late = _late_compile
        # What loading left is kept for the process's life: out of the collector's sight, a
        # step's allocations no longer bring full passes over the models' objects (half the
        # garbage collector's share of a CPU decode step).
        gc.collect()
        gc.freeze()
        if status is not None:
            status.registry = metrics.registry
            status.model_loaded = True
        def stop_all() -> None:
            for service in services:
                service.stop()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_all)
        codes = await asyncio.gather(*(s.run() for s in services))
        return max(codes)
    finally:
        for service in services:  # a parallel worker's other ranks stop with it
            service.engine.close()
            service.engine_thread.close()
        await redis.aclose()
        if status is not None:
            status.stop()


def _late_compile(done: Compile) -> None:
    log.warning("a Triton kernel compiled mid-run: %s in %.2f s, a stall of its step and of "
                "every job waiting behind it (a shape the warm-up did not cover)",
                done.kernel, done.seconds)


async def _model_service(settings: Settings, model: ServedModel, redis: aioredis.Redis,
                         worker_id: str, status: StatusServer | None) -> WorkerService:
    """One model's engine (its own settings), calibrated, its configured adapters loaded."""
    own = model.settings(settings)
    thread = EngineThread(f"engine-{model.name}")
    engine = await thread.run(build_engine, own)
    print(f"tidegate worker: {model.name}: {engine.kv_spec.describe()}", flush=True)
    shedder = LoadShedder(ShedderConfig(enabled=own.load_shedding, safety=own.shedding_safety))
    await thread.run(calibrate, engine, shedder)
    await thread.run(pace_steps, engine, shedder, own)
    service = WorkerService(
        redis, engine, model=model.name, worker_id=worker_id,
        partitions=own.lane_partitions, retention=Retention.from_settings(own),
        policy=QueuePolicy(int(own.visibility_timeout_s * 1000), own.max_deliveries,
                           own.drain_timeout_s),
        shedder=shedder, metrics=WorkerMetrics(engine), status=status,
        stream_interval_s=own.stream_interval_ms / 1000,
        prefix_routing=own.prefix_routing, steal_delay_ms=own.steal_delay_ms,
        engine_thread=thread,
    )
    await service.load_adapters(model.loras)
    return service
