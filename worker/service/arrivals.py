"""The worker's intake, beside the engine's steps: lane entries become arrivals.

While seats are free it reads (and now and then reclaims) lane entries, answers those that will
not run (malformed, dead-lettered, expired, cancelled, finished elsewhere: a job the API
rejected while it waited is acked unrun, an adapter nobody registered is rejected
``adapter_not_found``), claims the rest in one round trip, loads the adapters they name that
the engine lacks, and tokenizes them; the main loop admits the arrivals at its next step boundary,
where it can read the engine's state. It never touches the engine but for its counters. The
worker is full when no seat is free, when the engine had no room (KV blocks) for a waiting
request, or when it holds more than ``PREFILL_HORIZON_S`` of uncomputed prompt work; while full
it reads no jobs but still peeks at the head of each lane, to turn away at once the jobs that
could not finish in time even once a seat frees.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from tidegate import keys
from tidegate.events.event_feed import stored_events
from tidegate.events.event_log import last_event_id
from tidegate.jobstore import Claim, claim_many
from tidegate.protocol import Job, now_ms
from tidegate.redis_conn import is_transient
from tidegate.worker.engine.engine import Engine
from tidegate.worker.service.adapter_loader import AdapterLoader
from tidegate.worker.service.intake import Delivery, StreamIntake
from tidegate.worker.service.migration import Resume, resume_point
from tidegate.worker.service.publisher import EventPublisher
from tidegate.worker.shedding.load_shedder import Estimate, Load, LoadShedder

log = logging.getLogger("tidegate.worker")

IDLE_BLOCK_MS = 1000
BUSY_BLOCK_MS = 100  # a busy worker's intake waits this long for jobs, then looks again
PEEK_EVERY_S = 0.1
STEAL_LOOK_MIN_MS = 50  # other workers' streams are looked at no more often than this
PEEK_COUNT = 16
# A worker holding more prompt work than this (at its measured prefill rate) reads no more jobs:
# they wait on the lane for whichever worker starts them first. Below it a worker keeps reading
# while jobs wait only for its steps' token budgets, which start them within a few steps.
PREFILL_HORIZON_S = 0.5
PROMPT_LEN_CACHE = 1024
RETRY_S = 0.5
FINAL_STATUSES = frozenset({"done", "error", "rejected"})


@dataclass(frozen=True, slots=True)
class Arrival:
    """A job the intake claimed and tokenized, for the main loop to admit at a step boundary."""

    delivery: Delivery
    job: Job
    next_event_id: int
    taken_over: bool  # another worker ran it before (and died, or handed it back)
    prompt_ids: list[int]
    problem: str = ""  # the tokenizer or chat template refused it: answered invalid_request
    # A job taken over: the tokens it continues from; None: it cannot continue (restarts).
    resume: Resume | None = None


class ArrivalIntake:
    def __init__(
        self, redis: aioredis.Redis, engine: Engine, streams: StreamIntake,
        publisher: EventPublisher, shedder: LoadShedder, *, worker_id: str,
        visibility_timeout_ms: int, max_deliveries: int,
        running: Callable[[], list[Delivery]], wake: asyncio.Event,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.streams = streams
        self.publisher = publisher
        self.shedder = shedder
        self.tokenizer = engine.tokenizer
        self.worker_id = worker_id
        self.visibility_timeout_ms = visibility_timeout_ms
        self.max_deliveries = max_deliveries
        self.running = running  # the deliveries of the jobs the engine runs
        self.wake = wake  # set when arrivals are ready
        self.adapters = adapters  # loads the adapters jobs name (None: jobs name none)
        self.arrivals: list[Arrival] = []
        self.load: Load | None = None  # the engine's load, noted by the main loop when full
        self.ok = True  # Redis answered the last read
        self._boundary = asyncio.Event()
        self._last_reclaim = 0.0
        self._last_peek = 0.0
        self._last_steal = 0.0
        self._prompt_lens: OrderedDict[str, int] = OrderedDict()  # job id -> prompt tokens

    def held(self) -> list[Delivery]:
        """Every entry this worker holds: running, or claimed and waiting to be admitted."""
        return self.running() + [a.delivery for a in self.arrivals]

    async def run(self, draining: Callable[[], bool]) -> None:
        """Until the worker drains."""
        while not draining():
            try:
                await self._once()
                self.ok = True
            except RedisError as exc:
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    # Redis came back without our streams (no persistence): set them up again.
                    log.warning("consumer group missing; recreating it")
                    await self._ensure_groups()
                    continue
                if not is_transient(exc):
                    raise  # a refusal that waiting will not cure (WRONGTYPE): the intake dies
                log.warning("redis unavailable (%s); retrying", exc)
                self.ok = False
                await asyncio.sleep(RETRY_S)

    async def _ensure_groups(self) -> None:
        while True:
            try:
                return await self.streams.ensure_groups()
            except RedisError as exc:
                if not is_transient(exc):
                    raise  # e.g. a lane key that is not a stream: retrying would hang silently
                await asyncio.sleep(RETRY_S)

    def step_ended(self) -> None:
        """From the main loop: a step ended (seats may have freed)."""
        self._boundary.set()

    def take(self) -> list[Arrival]:
        """The arrivals prepared since the last call, for the main loop to admit."""
        taken, self.arrivals = self.arrivals, []
        return taken

    async def _once(self) -> None:
        engine = self.engine
        seats = engine.config.max_num_seqs - engine.num_active - len(self.arrivals)
        if seats <= 0 or engine.num_backlogged or self._prefill_backlog_s() > PREFILL_HORIZON_S:
            # Full: leave runnable jobs to other workers, but answer hopeless ones at once.
            await self._reject_hopeless_head()
            await self._next_boundary(PEEK_EVERY_S)
            return
        deliveries: list[Delivery] = []
        now = time.monotonic()
        if now - self._last_reclaim > self.visibility_timeout_ms / 4000:
            self._last_reclaim = now
            deliveries = await self.streams.reclaim(
                seats, min_idle_ms=self.visibility_timeout_ms)
        if len(deliveries) < seats:
            busy = engine.has_unfinished() or bool(deliveries or self.arrivals)
            block_ms = BUSY_BLOCK_MS if busy else IDLE_BLOCK_MS
            if not await self.streams.others():
                deliveries += await self.streams.read(seats - len(deliveries), block_ms=block_ms)
            else:
                # Other workers' streams exist: look at them about twice per steal delay, for
                # what waited there too long, once its own streams and the lane are empty (the
                # wait on those is cut short for it).
                every_ms = max(STEAL_LOOK_MIN_MS, self.streams.steal_delay_ms // 2)
                if (now - self._last_steal) * 1000 >= every_ms:
                    self._last_steal = now
                    deliveries += await self.streams.read(seats - len(deliveries), block_ms=0)
                    if len(deliveries) < seats:
                        deliveries += await self.streams.steal(seats - len(deliveries))
                if not deliveries:
                    deliveries = await self.streams.read(seats, block_ms=min(block_ms, every_ms))
        if deliveries:
            await self._prepare(deliveries)

    def _prefill_backlog_s(self) -> float:
        """Seconds of prompt work the engine holds and has not computed, at its measured rate."""
        return self.engine.pending_prefill_tokens / self.shedder.prefill_tok_s()

    async def _next_boundary(self, timeout_s: float) -> None:
        self._boundary.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._boundary.wait()

    async def _prepare(self, deliveries: list[Delivery]) -> None:
        """Claim the jobs (one round trip), answer those that will not run, tokenize the rest
        and hand them to the main loop."""
        if log.isEnabledFor(logging.DEBUG):  # how long the oldest waited in its stream
            waited = now_ms() - min(int(d.message_id.split("-")[0]) for d in deliveries)
            log.debug("intake: %d jobs, the oldest enqueued %d ms ago; engine: %d active, "
                      "%d waiting", len(deliveries), waited, self.engine.num_active,
                      self.engine.num_waiting)
        mine = self.held()
        held = {d.job.id for d in mine if d.job is not None}
        mine_ids = {(d.stream, d.message_id) for d in mine}
        claimable: list[Delivery] = []
        duplicates: list[Delivery] = []
        for delivery in deliveries:
            job = delivery.job
            if job is None:
                await self._malformed(delivery)
            elif (delivery.stream, delivery.message_id) in mine_ids:
                continue  # our own entry, reclaimed after an outage let it idle: still ours
            elif job.id in held:  # the same job delivered twice: the running copy wins
                duplicates.append(delivery)
            else:
                held.add(job.id)
                claimable.append(delivery)
        if duplicates:
            await self.streams.ack(duplicates)
        claims = await claim_many(self.redis, [(d.job.id, d.attempt) for d in claimable if d.job],
                                  self.worker_id)
        done: list[Delivery] = []
        now = now_ms()
        for delivery, claim in zip(claimable, claims, strict=True):
            job = delivery.job
            assert job is not None
            if claim.before in FINAL_STATUSES:  # cancelled while queued, or finished elsewhere
                done.append(delivery)
            elif claim.before == "missing":
                # Its record expired while it waited (a cancelled job's retention is minutes,
                # and enqueue writes the record before the entry): nobody waits for it.
                log.info("job %s has no record (expired): dropped", job.id)
                done.append(delivery)
            elif claim.before == "cancel_requested":
                self.publisher.cancelled_before_start(delivery, claim.next_event_id)
            elif claim.stalls >= self.max_deliveries:
                await self._dead_letter(delivery, job, claim)
            elif job.deadline_ms <= now:
                self.publisher.fail(delivery, claim.next_event_id, code="deadline_exceeded",
                                    rejected=True,
                                    message="the deadline passed before a worker could start")
            elif job.adapter is not None and (problem := await self._adapter(job.adapter)):
                code, message = problem
                self.publisher.fail(delivery, claim.next_event_id, code=code, message=message,
                                    rejected=code == "adapter_not_found")
            else:
                taken_over = claim.before == "running" or delivery.attempt > 1
                resume = await self._resume_point(job) if taken_over else None
                self.arrivals.append(self._tokenized(delivery, job, claim.next_event_id,
                                                      taken_over, resume))
        if done:
            await self.streams.ack(done)
        self.wake.set()

    async def _adapter(self, name: str) -> tuple[str, str] | None:
        """None once the engine holds adapter ``name``; else the job's (code, message)."""
        if self.adapters is None:
            return "adapter_not_found", f"adapter {name!r}: this worker serves no adapters"
        return await self.adapters.ensure(name)

    async def _resume_point(self, job: Job) -> Resume | None:
        """Where a job taken over continues: the tokens its stored events hold."""
        return resume_point(await stored_events(self.redis, job.id))

    def _tokenized(self, delivery: Delivery, job: Job, next_id: int, taken_over: bool,
                   resume: Resume | None) -> Arrival:
        try:
            prompt_ids = self.tokenizer.encode_prompt(job.prompt, job.messages,
                                                      job.rendered_tools())
        except ValueError as exc:  # a chat template refusing the messages
            return Arrival(delivery, job, next_id, taken_over, [], str(exc))
        return Arrival(delivery, job, next_id, taken_over, prompt_ids, resume=resume)

    async def _malformed(self, delivery: Delivery) -> None:
        log.warning("malformed job %s on %s: %s", delivery.message_id, delivery.stream,
                    delivery.problem)
        next_id = await last_event_id(self.redis, delivery.job_id) + 1 if delivery.job_id else 0
        self.publisher.fail(delivery, next_id, code="invalid_job", message=delivery.problem)

    async def _dead_letter(self, delivery: Delivery, job: Job, claim: Claim) -> None:
        """Move a job whose workers keep dying before its first new token (poison) to the
        lane's dead-letter stream and end it. Deliveries that made progress don't count."""
        last_error = (f"its worker stopped responding before generating a token on each of "
                      f"{claim.stalls} deliveries in a row")
        await self.redis.xadd(keys.dead_letter_stream(job.lane), {
            "job": job.model_dump_json(), "job_id": job.id, "attempts": str(delivery.attempt),
            "stalls": str(claim.stalls), "error": last_error, "stream": delivery.stream,
            "message_id": delivery.message_id,
        }, maxlen=keys.DEAD_LETTER_MAXLEN, approximate=True)
        self.publisher.fail(delivery, claim.next_event_id, code="dead_lettered",
                            message=f"gave up after {claim.stalls} attempts: {last_error}")

    async def _reject_hopeless_head(self) -> None:
        """Take the leading run of undelivered jobs that could not finish in time even once
        this worker's first seat frees; the main loop rejects them now rather than when a
        seat frees. Judged by ``load``, the engine's load the main loop last noted."""
        load = self.load
        if not self.shedder.config.enabled or load is None:
            return
        if time.monotonic() - self._last_peek < PEEK_EVERY_S:
            return
        self._last_peek = time.monotonic()
        for stream in self.streams.streams:
            hopeless = 0
            for entry in await self.streams.peek(stream, PEEK_COUNT):
                job = entry.job
                if job is None or self._estimate(job, self._prompt_len(job), load).admit:
                    break
                hopeless += 1
            if hopeless:
                # Another worker may have taken some meanwhile; the main loop judges each again.
                await self._prepare(await self.streams.read_from(stream, hopeless))

    def _estimate(self, job: Job, prompt_tokens: int, load: Load) -> Estimate:
        time_left = (job.deadline_ms - now_ms()) / 1000
        return self.shedder.estimate(prompt_tokens, job.sampling.max_tokens, load, time_left)

    def _prompt_len(self, job: Job) -> int:
        # A full worker peeks at the same waiting jobs every PEEK_EVERY_S: tokenize each once.
        n = self._prompt_lens.get(job.id)
        if n is None:
            try:
                n = len(self.tokenizer.encode_prompt(job.prompt, job.messages,
                                                     job.rendered_tools()))
            except ValueError:
                n = 0  # _admit will answer it with the proper error
            self._prompt_lens[job.id] = n
            if len(self._prompt_lens) > PROMPT_LEN_CACHE:
                self._prompt_lens.popitem(last=False)
        return n
