"""Token publishing: engine outputs become wire events, one Redis pipeline per step.

Each event is XADDed to the job's event stream and PUBLISHed on its channel; a finished job's
result is stored in its hash in the same pipeline, and only after that pipeline has executed is
the job acknowledged on its lane stream (at-least-once: never ack what isn't stored).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.jobstore import add_event, last_event_id, set_status
from tidegate.protocol import (
    DoneEvent,
    ErrorEvent,
    Job,
    RejectedEvent,
    StartedEvent,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
    now_ms,
)
from worker.engine import RequestOutput
from worker.intake import Delivery, StreamIntake


@dataclass(slots=True)
class ActiveJob:
    """What the worker tracks for a job the engine is running."""

    job: Job
    delivery: Delivery
    next_event_id: int
    prompt_tokens: int
    started_ms: int
    first_token_ms: int | None = None

    def take_id(self) -> int:
        self.next_event_id += 1
        return self.next_event_id - 1


class EventPublisher:
    def __init__(
        self, redis: aioredis.Redis, intake: StreamIntake, worker_id: str,
        *, ttl_s: int = keys.JOB_TTL_S,
    ) -> None:
        self.redis = redis
        self.intake = intake
        self.worker_id = worker_id
        self.ttl_s = ttl_s

    async def start(self, job: Job, delivery: Delivery, prompt_tokens: int) -> ActiveJob:
        """Mark the job running and publish ``started``, continuing the job's event ids."""
        active = ActiveJob(job, delivery, await last_event_id(self.redis, job.id) + 1,
                           prompt_tokens, now_ms())
        event = StartedEvent(id=active.take_id(), job_id=job.id, worker=self.worker_id,
                             prompt_tokens=prompt_tokens)
        pipe = self.redis.pipeline(transaction=False)
        set_status(pipe, job.id, "running")
        add_event(pipe, job.id, event.model_dump_json(), ttl_s=self.ttl_s)
        await pipe.execute()
        return active

    async def publish_step(
        self, outputs: list[RequestOutput], active: dict[str, ActiveJob]
    ) -> list[ActiveJob]:
        """Publish one step's events for every job; store and ack the finished ones."""
        pipe = self.redis.pipeline(transaction=False)
        finished: list[ActiveJob] = []
        stamp = now_ms()
        for out in outputs:
            job = active[out.request_id]
            if out.token_id is not None:
                job.first_token_ms = job.first_token_ms or stamp
                token = TokenEvent(id=job.take_id(), job_id=job.job.id, index=out.index,
                                   text=out.text, token_ids=[out.token_id])
                if out.logprobs is not None:
                    token.logprob = out.logprobs.logprob
                    token.top_logprobs = [TopLogprob(token_id=t, logprob=lp)
                                          for t, lp in out.logprobs.top]
                # Logprob fields appear only on jobs that asked for them.
                add_event(pipe, job.job.id, token.model_dump_json(exclude_none=True),
                          ttl_s=self.ttl_s)
            if out.finish_reason is not None:
                self._finish(pipe, job, out, stamp)
                finished.append(job)
        await pipe.execute()
        await self.intake.ack([job.delivery for job in finished])
        return finished

    def _finish(
        self, pipe: aioredis.client.Pipeline, job: ActiveJob, out: RequestOutput, stamp: int
    ) -> None:
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
        done = DoneEvent(id=job.take_id(), job_id=job.job.id, finish_reason=out.finish_reason,
                         text=out.output_text, usage=usage, timings=timings)
        result = {"text": out.output_text, "finish_reason": out.finish_reason,
                  "usage": usage.model_dump(), "timings": timings.model_dump()}
        set_status(pipe, job.job.id, "done", result=json.dumps(result))
        add_event(pipe, job.job.id, done.model_dump_json(), ttl_s=self.ttl_s)

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
