"""Token publishing: engine outputs become wire events, one Redis pipeline per step.

Each event is XADDed to the job's event stream and PUBLISHed on its channel; a finished job's
result is stored in its hash in the same pipeline, and only after that pipeline has executed is
the job acknowledged on its lane stream (at-least-once: never ack what isn't stored). A step's
events get their ids once, when prepared, so a batch that failed on a Redis outage is sent again
unchanged; followers drop ids they have already seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.jobstore import JOB_FIELD, add_event, last_event_id, set_status
from tidegate.protocol import (
    DoneEvent,
    ErrorEvent,
    FinishReason,
    Job,
    RejectedEvent,
    RestartedEvent,
    StartedEvent,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
    now_ms,
)
from worker.engine import RequestOutput
from worker.intake import Delivery, StreamIntake
from worker.metrics import OUTCOMES, WorkerMetrics, outcome_of_finish


@dataclass(slots=True)
class ActiveJob:
    """What the worker tracks for a job the engine is running."""

    job: Job
    delivery: Delivery
    next_event_id: int
    prompt_tokens: int
    started_ms: int
    first_token_ms: int | None = None
    last_token_ms: int | None = None

    def take_id(self) -> int:
        self.next_event_id += 1
        return self.next_event_id - 1


@dataclass(slots=True)
class StepBatch:
    """One step's writes, ids assigned: safe to execute again after a failure."""

    events: list[tuple[str, str]] = field(default_factory=list)  # (job id, event JSON)
    statuses: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    finished: list[ActiveJob] = field(default_factory=list)


class EventPublisher:
    def __init__(
        self, redis: aioredis.Redis, intake: StreamIntake, worker_id: str,
        *, ttl_s: int = keys.JOB_TTL_S, metrics: WorkerMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.intake = intake
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.metrics = metrics or WorkerMetrics()

    async def start(
        self, job: Job, delivery: Delivery, prompt_tokens: int, *, restarted: bool
    ) -> ActiveJob:
        """Publish ``started`` (after ``restarted`` for a job taken over from a dead worker)."""
        active = ActiveJob(job, delivery, await last_event_id(self.redis, job.id) + 1,
                           prompt_tokens, now_ms())
        batch = StepBatch()
        if restarted:
            batch.events.append((job.id, RestartedEvent(
                id=active.take_id(), job_id=job.id, attempt=max(delivery.attempt, 2),
            ).model_dump_json()))
        batch.events.append((job.id, StartedEvent(
            id=active.take_id(), job_id=job.id, worker=self.worker_id, prompt_tokens=prompt_tokens,
        ).model_dump_json()))
        await self.flush(batch)
        return active

    def prepare_step(self, outputs: list[RequestOutput], active: dict[str, ActiveJob]) -> StepBatch:
        batch = StepBatch()
        stamp = now_ms()
        for out in outputs:
            job = active[out.request_id]
            if out.token_id is not None:
                job.first_token_ms = job.first_token_ms or stamp
                if job.last_token_ms is not None:
                    self.metrics.inter_token.observe((stamp - job.last_token_ms) / 1000)
                job.last_token_ms = stamp
                batch.events.append((job.job.id, self._token(job, out)))
            if out.finish_reason is not None:
                self._finish(batch, job, out, stamp)
        return batch

    async def flush(self, batch: StepBatch) -> None:
        """Write the batch's events and results, then ack its finished jobs."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, status, fields in batch.statuses:
            set_status(pipe, job_id, status, **fields)
        for job_id, raw in batch.events:
            add_event(pipe, job_id, raw, ttl_s=self.ttl_s)
        await pipe.execute()
        await self.intake.ack([job.delivery for job in batch.finished])

    def _token(self, job: ActiveJob, out: RequestOutput) -> str:
        token = TokenEvent(id=job.take_id(), job_id=job.job.id, index=out.index, text=out.text,
                           token_ids=[out.token_id] if out.token_id is not None else [])
        if out.logprobs is not None:
            token.logprob = out.logprobs.logprob
            token.top_logprobs = [TopLogprob(token_id=t, logprob=lp) for t, lp in out.logprobs.top]
        # Logprob fields appear only on jobs that asked for them.
        return token.model_dump_json(exclude_none=True)

    def _finish(self, batch: StepBatch, job: ActiveJob, out: RequestOutput, stamp: int) -> None:
        created = job.job.created_ms
        first = job.first_token_ms or stamp
        decode_s = (stamp - first) / 1000
        timings = Timings(
            queue_ms=job.started_ms - created,
            ttft_ms=first - created,
            total_ms=stamp - created,
            decode_tokens_per_s=(out.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
        )
        usage = Usage(prompt_tokens=out.num_prompt_tokens,
                      completion_tokens=out.num_output_tokens,
                      total_tokens=out.num_prompt_tokens + out.num_output_tokens)
        reason: FinishReason = out.finish_reason or "stop"
        done = DoneEvent(id=job.take_id(), job_id=job.job.id, finish_reason=reason,
                         text=out.output_text, usage=usage, timings=timings)
        result = {"text": out.output_text, "finish_reason": reason,
                  "usage": usage.model_dump(), "timings": timings.model_dump()}
        batch.statuses.append((job.job.id, "done", {"result": json.dumps(result)}))
        batch.events.append((job.job.id, done.model_dump_json()))
        batch.finished.append(job)
        m = self.metrics
        m.queue_wait.observe(timings.queue_ms / 1000)
        m.ttft.observe(timings.ttft_ms / 1000)
        m.e2e.observe(timings.total_ms / 1000)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.outcome(outcome_of_finish(reason))

    # ------------------------------------------------------------------ jobs that never run

    async def fail(
        self, delivery: Delivery, *, code: str, message: str, rejected: bool = False
    ) -> None:
        """End a job that will not run (``error`` or ``rejected``), then ack it."""
        job_id = delivery.job.id if delivery.job else delivery.job_id
        if job_id is not None:
            event_id = await last_event_id(self.redis, job_id) + 1
            if rejected:
                event = RejectedEvent(id=event_id, job_id=job_id, reason=code, message=message)
            else:
                event = ErrorEvent(id=event_id, job_id=job_id, code=code, message=message)
            pipe = self.redis.pipeline(transaction=False)
            set_status(pipe, job_id, "rejected" if rejected else "error",
                       error=json.dumps({"code": code, "message": message}))
            pipe.expire(keys.job_hash(job_id), self.ttl_s)
            add_event(pipe, job_id, event.model_dump_json(), ttl_s=self.ttl_s)
            await pipe.execute()
        await self.intake.ack([delivery])
        self.metrics.outcome(code if code in OUTCOMES else "error")

    async def cancelled_before_start(self, delivery: Delivery) -> None:
        """A job whose cancel was requested before this worker could run it."""
        assert delivery.job is not None
        job = delivery.job
        waited = float(now_ms() - job.created_ms)
        timings = Timings(queue_ms=waited, ttft_ms=waited, total_ms=waited, decode_tokens_per_s=0)
        usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        done = DoneEvent(id=await last_event_id(self.redis, job.id) + 1, job_id=job.id,
                         finish_reason="cancelled", text="", usage=usage, timings=timings)
        result = {"text": "", "finish_reason": "cancelled", "usage": usage.model_dump(),
                  "timings": timings.model_dump()}
        batch = StepBatch(events=[(job.id, done.model_dump_json())],
                          statuses=[(job.id, "done", {"result": json.dumps(result)})])
        await self.flush(batch)
        await self.intake.ack([delivery])
        self.metrics.outcome("cancelled")

    async def dead_letter(self, delivery: Delivery, *, lane: str, last_error: str) -> None:
        """Move a job that keeps failing to the lane's dead-letter stream and end it."""
        raw = delivery.job.model_dump_json() if delivery.job else ""
        await self.redis.xadd(keys.dead_letter_stream(lane), {
            JOB_FIELD: raw, "job_id": delivery.job_id or "", "attempts": str(delivery.attempt),
            "error": last_error, "stream": delivery.stream, "message_id": delivery.message_id,
        }, maxlen=keys.LANE_MAXLEN, approximate=True)
        await self.fail(delivery, code="dead_lettered",
                        message=f"gave up after {delivery.attempt - 1} attempts: {last_error}")
