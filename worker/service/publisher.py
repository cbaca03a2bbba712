"""Event publishing beside the engine: outputs are recorded per job, and a writer task turns
whatever accumulated into one ``EventBatch`` and writes it while the engine computes the next
step.

The main loop only records (``record``: a few list appends per token); the writer takes a
snapshot, assigns event ids, encodes the events and writes them with ``tidegate.events.event_log``
(one script call: events stored, results stored, events published, finished jobs acked). While
one write is in flight the next steps' outputs accumulate, so under load a job's tokens of
several steps leave as one ``token`` event. ``interval_s`` sets a minimum time between writes,
which coalesces more; a job's start, first token and end are written at once all the same
(time to first token and to the result don't wait for it).
A write that fails (Redis down) is retried unchanged, ids included, until it succeeds; Redis
refuses an event id it already stores, so nothing is stored twice. ``healthy`` is clear
meanwhile, and the worker stops stepping until it is set again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tidegate import keys
from tidegate.cancelling import cancel_and_wait
from tidegate.events.event_log import EventBatch, EventLog, Written
from tidegate.protocol import (
    Choice,
    DoneEvent,
    ErrorEvent,
    FinishReason,
    FunctionCall,
    Job,
    MigratedEvent,
    RejectedEvent,
    RestartedEvent,
    StartedEvent,
    Timings,
    TokenEvent,
    ToolCall,
    TopLogprob,
    Usage,
    now_ms,
    token_event_json,
)
from tidegate.retention import Retention
from tidegate.structured.tool_calls import ToolFormat, new_call_id
from tidegate.worker.engine.engine import RequestOutput
from tidegate.worker.engine.sampler import TokenLogprobs
from tidegate.worker.service.intake import Delivery
from tidegate.worker.service.metrics import OUTCOMES, WorkerMetrics, outcome_of_finish

log = logging.getLogger("tidegate.worker")

RETRY_S = 0.5
STALL_S = 1.0  # a write in flight this long (Redis unreachable, client retrying) holds the engine


@dataclass(slots=True)
class ChoiceTokens:
    """A further choice of a job with n > 1: its tokens not written yet, and its end."""

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    end: RequestOutput | None = None


@dataclass(slots=True)
class ActiveJob:
    """A job the engine is running, and what of it is not written yet (its first choice's
    tokens here, the others' in ``choices``)."""

    job: Job
    delivery: Delivery
    next_event_id: int
    prompt_tokens: int
    started_ms: int
    restart_attempt: int | None = None  # announce ``restarted`` first (another worker died)
    # (attempt, kept tokens): a job continued from another worker's tokens announces
    # ``migrated`` instead of ``started``.
    migrated: tuple[int, int] | None = None
    first_token_ms: int | None = None
    last_token_ms: int | None = None
    announced: bool = False  # ``started`` went into a batch
    # Tokens since the last snapshot: their ids, texts and (jobs asking for them) logprobs.
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    end: RequestOutput | None = None  # the output that finished it
    end_ms: int = 0
    job_id: str = ""  # job.id, kept at hand for the hot path
    shard: int = -1  # its live channel (keys.live_shard)
    choices: list[ChoiceTokens] = field(default_factory=list)  # choices 1..n-1
    first_end: RequestOutput | None = None  # n > 1: the first choice's end, before all end

    def __post_init__(self) -> None:
        self.job_id = self.job.id
        self.shard = keys.live_shard(self.job_id)
        self.choices = [ChoiceTokens() for _ in range(self.job.sampling.n - 1)]

    def ended(self, out: RequestOutput) -> bool:
        """Note a choice's end; whether the job ended (every choice did)."""
        if not self.choices:
            return True
        if out.choice == 0:
            self.first_end = out
        else:
            self.choices[out.choice - 1].end = out
        return self.first_end is not None and all(c.end is not None for c in self.choices)

    def take_id(self) -> int:
        self.next_event_id += 1
        return self.next_event_id - 1


@dataclass(frozen=True, slots=True)
class Ending:
    """The one event of a job that will not run (error, rejection, cancelled before start)."""

    delivery: Delivery
    job_id: str | None  # None: nothing to tell anyone (a malformed entry without an id)
    kind: str
    raw: str
    event_id: int
    fields: dict[str, str]
    outcome: str | None  # the metrics' outcome label; None: nothing ended (a duplicate)
    ttl_s: int = 0  # the job's retention from now on (``tidegate.retention``)


class EventPublisher:
    def __init__(
        self, redis: aioredis.Redis, worker_id: str, *, retention: Retention | None = None,
        metrics: WorkerMetrics | None = None, interval_s: float = 0.0,
        on_finished: Callable[[ActiveJob], None] = lambda job: None,
        on_lost: Callable[[list[str]], None] = lambda job_ids: None,
        tool_format: ToolFormat | None = None,
    ) -> None:
        self.retention = retention or Retention()
        self.tool_format = tool_format  # reads the calls of jobs with tools out of their text
        # Fenced by this worker's id: a job another worker took over gets no more writes.
        self.log = EventLog(redis, ttl_s=self.retention.unfinished_s, owner=worker_id)
        self.worker_id = worker_id
        self.metrics = metrics or WorkerMetrics()
        self.interval_s = interval_s
        self.on_finished = on_finished  # a finished job's result is stored and acked
        self.on_lost = on_lost  # jobs another worker owns now: this one must drop them
        self.healthy = asyncio.Event()  # the last write succeeded
        self.healthy.set()
        self._write_since: float | None = None  # monotonic start of the write in flight
        self._dirty: dict[str, ActiveJob] = {}  # jobs with something unwritten, in order
        self._endings: list[Ending] = []
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()  # something the interval must not hold back
        self._idle = asyncio.Event()  # nothing unwritten, nothing in flight
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ from the main loop

    def announce(self, job: ActiveJob) -> None:
        """``started`` (after ``restarted`` for a job taken over from a dead worker that
        starts over), or ``migrated`` (one that continues)."""
        self._mark(job)
        self._urgent.set()

    def record(self, outputs: list[RequestOutput], active: dict[str, ActiveJob]) -> None:
        """Note one step's outputs; the writer sends them with whatever else accumulated."""
        if not outputs:
            return
        cpu = time.thread_time()
        stamp = now_ms()
        gaps: dict[int, int] = {}
        dirty = self._dirty
        for out in outputs:
            job = active.get(out.request_id)
            if job is None:  # lost to another worker, and aborted here: nothing to write
                continue
            if out.token_id is not None:
                tokens: ActiveJob | ChoiceTokens = (
                    job.choices[out.choice - 1] if out.choice else job)
                if not tokens.token_ids:
                    tokens.index = out.index
                tokens.token_ids.append(out.token_id)
                tokens.texts.append(out.text)
                if out.logprobs is not None:
                    tokens.logprobs.append(out.logprobs)
                if job.last_token_ms is None:
                    job.first_token_ms = stamp
                    self._urgent.set()
                else:
                    gap = stamp - job.last_token_ms
                    gaps[gap] = gaps.get(gap, 0) + 1
                job.last_token_ms = stamp
            if out.finish_reason is not None and job.ended(out):
                job.end, job.end_ms = job.first_end or out, stamp
                self._urgent.set()
            dirty[out.request_id] = job
        for gap, count in gaps.items():
            self.metrics.inter_token.observe(gap / 1000, count)
        self._wake_writer()
        self.metrics.publish_cpu_seconds.inc(time.thread_time() - cpu)

    def fail(self, delivery: Delivery, next_event_id: int, *, code: str, message: str,
             rejected: bool = False) -> None:
        """End a job that will not run (``error`` or ``rejected``); acked once written."""
        job_id = delivery.job.id if delivery.job else delivery.job_id
        outcome = code if code in OUTCOMES else "error"
        if job_id is None:
            self._end(Ending(delivery, None, "", "", 0, {}, outcome))
            return
        if rejected:
            event: RejectedEvent | ErrorEvent = RejectedEvent(
                id=next_event_id, job_id=job_id, reason=code, message=message)
        else:
            event = ErrorEvent(id=next_event_id, job_id=job_id, code=code, message=message)
        status = "rejected" if rejected else "error"
        fields = {"status": status, "error": json.dumps({"code": code, "message": message})}
        self._end(Ending(delivery, job_id, event.type, event.model_dump_json(), next_event_id,
                         fields, outcome, self.retention.final_s(status)))

    def ack_only(self, delivery: Delivery) -> None:
        """Ack an entry that needs no event (a second delivery of a job running here)."""
        self._end(Ending(delivery, None, "", "", 0, {}, None))

    def cancelled_before_start(self, delivery: Delivery, next_event_id: int) -> None:
        """A job whose cancel was requested before this worker could run it."""
        assert delivery.job is not None
        job = delivery.job
        waited = float(now_ms() - job.created_ms)
        timings = Timings(queue_ms=waited, ttft_ms=waited, total_ms=waited, decode_tokens_per_s=0)
        usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        done = DoneEvent(id=next_event_id, job_id=job.id, finish_reason="cancelled", text="",
                         usage=usage, timings=timings)
        result = {"text": "", "finish_reason": "cancelled", "usage": usage.model_dump(),
                  "timings": timings.model_dump()}
        self._end(Ending(delivery, job.id, "done", done.model_dump_json(), next_event_id,
                         {"status": "done", "result": json.dumps(result)}, "cancelled",
                         self.retention.cancelled_s))

    @property
    def stalled(self) -> bool:
        """The last write failed, or one has been in flight for over ``STALL_S``."""
        since = self._write_since
        return not self.healthy.is_set() or (since is not None
                                             and time.monotonic() - since > STALL_S)

    @property
    def unwritten(self) -> int:
        """Jobs (and endings) with something not yet written."""
        return len(self._dirty) + len(self._endings)

    # ------------------------------------------------------------------ the writer

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-writer")

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._task] if self._task is not None else []

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def flush(self) -> None:
        """Until everything recorded so far is written (retrying through an outage)."""
        self._wake_writer()
        await self._idle.wait()

    async def _run(self) -> None:
        last = 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            delay = last + self.interval_s - time.monotonic()
            if delay > 0 and not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._urgent.wait()
            self._urgent.clear()
            cpu = time.thread_time()
            batch, finished = self._snapshot()
            self.metrics.publish_cpu_seconds.inc(time.thread_time() - cpu)
            if batch:
                written = await self._write(batch)
                self.metrics.event_writes.inc()
                self.metrics.events_written.inc(batch.events)
                last = time.monotonic()
                lost = set(written.lost)
                if lost:
                    self._drop(lost)
                for job in finished:
                    if job.job_id not in lost:
                        self.on_finished(job)
            if not self._dirty and not self._endings:
                self._idle.set()

    async def _write(self, batch: EventBatch) -> Written:
        self._write_since = time.monotonic()
        try:
            while True:
                try:
                    written = await self.log.write(batch)
                    self.healthy.set()
                    return written
                except RedisError as exc:
                    if self.healthy.is_set():
                        log.warning("redis unavailable (%s); holding %d events", exc,
                                    batch.events)
                    self.healthy.clear()
                    await asyncio.sleep(RETRY_S)
        finally:
            self._write_since = None

    def _drop(self, lost: set[str]) -> None:
        """Jobs whose entries another worker reclaimed while this one could not reach Redis
        (it went on computing them): that worker continues them from what was stored, so
        nothing more of them is written here."""
        log.warning("%d jobs were taken over by another worker while Redis was out of reach; "
                    "dropping them here", len(lost))
        for job_id in lost:
            self._dirty.pop(job_id, None)
        self.metrics.lost_jobs.inc(len(lost))
        self.on_lost(sorted(lost))

    def _mark(self, job: ActiveJob) -> None:
        self._dirty[job.job.id] = job
        self._wake_writer()

    def _end(self, ending: Ending) -> None:
        self._endings.append(ending)
        self._urgent.set()
        self._wake_writer()

    def _wake_writer(self) -> None:
        self._idle.clear()
        self._wake.set()

    def _snapshot(self) -> tuple[EventBatch, list[ActiveJob]]:
        """Everything unwritten as one batch, ids assigned: safe to write again after a failure."""
        batch, finished = EventBatch(), []
        dirty, self._dirty = self._dirty, {}
        for job in dirty.values():
            batch.own(job.job_id)
            self._job_events(batch, job)
            if job.end is not None:
                self._finish(batch, job)
                finished.append(job)
        endings, self._endings = self._endings, []
        for ending in endings:
            if ending.job_id is not None:
                batch.set_fields(ending.job_id, ending.fields)
                batch.add_event(ending.job_id, ending.event_id, ending.kind, ending.raw)
                batch.refresh_ttl(ending.job_id, ending.ttl_s)
            batch.ack(ending.delivery.stream, ending.delivery.message_id)
            if ending.outcome is not None:
                self.metrics.outcome(ending.outcome)
        return batch, finished

    def _job_events(self, batch: EventBatch, job: ActiveJob) -> None:
        if not job.announced:
            self._announce(batch, job)
        for k, tokens in enumerate(job.choices, start=1):
            if tokens.token_ids:
                self._choice_events(batch, job, k, tokens)
        if not job.token_ids:
            return
        if job.logprobs:
            self._logprob_events(batch, job)
            return
        # The hot path (every running job, every write): one event, its line built in place.
        job_id, event_id, texts = job.job_id, job.next_event_id, job.texts
        job.next_event_id = event_id + 1
        raw = token_event_json(event_id, job_id, job.index,
                               texts[0] if len(texts) == 1 else "".join(texts), job.token_ids)
        batch.lines[job.shard].append(f"{job_id} {event_id} token {raw}")
        batch.events += 1
        job.token_ids, job.texts = [], []

    def _announce(self, batch: EventBatch, job: ActiveJob) -> None:
        job_id = job.job_id
        job.announced = True
        if job.migrated is not None:
            attempt, kept = job.migrated
            raw = MigratedEvent(id=job.next_event_id, job_id=job_id, worker=self.worker_id,
                                attempt=attempt, kept_tokens=kept).model_dump_json()
            batch.add_event(job_id, job.take_id(), "migrated", raw, job.shard)
            batch.refresh_ttl(job_id)
            return
        if job.restart_attempt is not None:
            raw = RestartedEvent(id=job.next_event_id, job_id=job_id,
                                 attempt=job.restart_attempt).model_dump_json()
            batch.add_event(job_id, job.take_id(), "restarted", raw, job.shard)
        raw = StartedEvent(id=job.next_event_id, job_id=job_id, worker=self.worker_id,
                           prompt_tokens=job.prompt_tokens).model_dump_json()
        batch.add_event(job_id, job.take_id(), "started", raw, job.shard)
        batch.refresh_ttl(job_id)

    def _choice_events(self, batch: EventBatch, job: ActiveJob, k: int,
                       tokens: ChoiceTokens) -> None:
        """A further choice's tokens: one event, or one per token with logprobs."""
        if tokens.logprobs:
            spans = [(tokens.index + i, [t], text, lp) for i, (t, text, lp) in enumerate(
                zip(tokens.token_ids, tokens.texts, tokens.logprobs, strict=True))]
        else:
            spans = [(tokens.index, tokens.token_ids, "".join(tokens.texts), None)]
        for index, ids, text, lp in spans:
            event = TokenEvent(
                id=job.next_event_id, job_id=job.job_id, index=index, choice=k, text=text,
                token_ids=ids, logprob=lp.logprob if lp else None,
                top_logprobs=[TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
                if lp else None)
            batch.add_event(job.job_id, job.take_id(), "token",
                            event.model_dump_json(exclude_none=True), job.shard)
        tokens.token_ids, tokens.texts, tokens.logprobs = [], [], []

    def _logprob_events(self, batch: EventBatch, job: ActiveJob) -> None:
        """One event per token: each carries its own logprobs."""
        for i, (token, text, lp) in enumerate(zip(job.token_ids, job.texts, job.logprobs,
                                                  strict=True)):
            event = TokenEvent(
                id=job.next_event_id, job_id=job.job_id, index=job.index + i, text=text,
                token_ids=[token], logprob=lp.logprob,
                top_logprobs=[TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            batch.add_event(job.job_id, job.take_id(), "token",
                            event.model_dump_json(exclude_none=True), job.shard)
        job.token_ids, job.texts, job.logprobs = [], [], []

    def _finish(self, batch: EventBatch, job: ActiveJob) -> None:
        out, stamp = job.end, job.end_ms
        assert out is not None
        created = job.job.created_ms
        first = job.first_token_ms or stamp
        decode_s = (stamp - first) / 1000
        # A migrated job's timings are its last run's (its first token: this run's first).
        decoded = out.num_output_tokens - 1 - (job.migrated[1] if job.migrated else 0)
        timings = Timings(
            queue_ms=job.started_ms - created,
            ttft_ms=first - created,
            total_ms=stamp - created,
            decode_tokens_per_s=decoded / decode_s if decode_s > 0 and decoded > 0 else 0.0,
        )
        ends = [out, *(c.end for c in job.choices if c.end is not None)]
        completion = sum(e.num_output_tokens for e in ends)
        usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=completion,
                      total_tokens=out.num_prompt_tokens + completion)
        reason: FinishReason = out.finish_reason or "stop"
        calls = tool_calls_of(job.job, out.output_text, self.tool_format)
        choices = None
        if job.choices:
            choices = [Choice(index=k, text=e.output_text, finish_reason=e.finish_reason or "stop",
                              completion_tokens=e.num_output_tokens,
                              tool_calls=tool_calls_of(job.job, e.output_text, self.tool_format)
                              if k else calls)
                       for k, e in enumerate(ends)]
        done = DoneEvent(id=job.next_event_id, job_id=job.job.id, finish_reason=reason,
                         text=out.output_text, tool_calls=calls, choices=choices, usage=usage,
                         timings=timings)
        result = {"text": out.output_text, "finish_reason": reason,
                  "usage": usage.model_dump(), "timings": timings.model_dump()}
        if calls is not None:
            result["tool_calls"] = [c.model_dump() for c in calls]
        if choices is not None:
            result["choices"] = [c.model_dump(exclude_none=True) for c in choices]
        batch.set_fields(job.job.id, {"status": "done", "result": json.dumps(result)})
        batch.add_event(job.job.id, job.take_id(), "done", done.model_dump_json(exclude_none=True),
                        job.shard)
        batch.refresh_ttl(job.job.id, self.retention.final_s("done", reason))
        batch.ack(job.delivery.stream, job.delivery.message_id, job.job.id)
        m = self.metrics
        m.queue_wait.observe(timings.queue_ms / 1000)
        m.ttft.observe(timings.ttft_ms / 1000)
        m.e2e.observe(timings.total_ms / 1000)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.outcome(outcome_of_finish(reason))


def tool_calls_of(job: Job, text: str, fmt: ToolFormat | None) -> list[ToolCall] | None:
    """The calls in a finished job's text, for a job that offered tools (None otherwise)."""
    if fmt is None or not job.rendered_tools():
        return None
    _, calls = fmt.parse(text)
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]
