"""A job's durable record in Redis: enqueue, status, result.

The job hash holds ``job`` (the Job JSON), ``status``, and when finished ``result`` (text,
finish_reason, usage, timings) or ``error`` ({code, message}). Producers write it at submit,
workers at start and finish; everybody reads it through ``read_result``.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.protocol import Job, JobResult, QueuedEvent

EVENT_FIELD = "e"  # the one field of an event stream entry: the event's JSON
JOB_FIELD = "job"  # the one field of a lane stream entry: the Job's JSON


async def enqueue(
    redis: aioredis.Redis, job: Job, *, partition: int = 0, ttl_s: int = keys.JOB_TTL_S
) -> None:
    """Record the job and its ``queued`` event, then put it on its lane stream.

    The job's keys share one slot and are written first, so a job visible to workers always
    has its record; the lane stream lives in another slot and is written last.
    """
    queued = QueuedEvent(id=1, job_id=job.id, lane=job.lane)
    pipe = redis.pipeline(transaction=True)
    pipe.hset(keys.job_hash(job.id), mapping={"job": job.model_dump_json(), "status": "queued"})
    pipe.expire(keys.job_hash(job.id), ttl_s)
    pipe.xadd(keys.job_events(job.id), {EVENT_FIELD: queued.model_dump_json()})
    pipe.expire(keys.job_events(job.id), ttl_s)
    await pipe.execute()
    await redis.xadd(
        keys.lane_stream(job.lane, partition),
        {JOB_FIELD: job.model_dump_json()},
        maxlen=keys.LANE_MAXLEN,
        approximate=True,
    )


async def read_result(redis: aioredis.Redis, job_id: str) -> JobResult | None:
    """The job's status and, when finished, its result; None for an unknown job."""
    record = await redis.hgetall(keys.job_hash(job_id))
    if not record or "job" not in record:
        return None
    job = json.loads(record["job"])
    fields: dict[str, object] = {
        "id": job_id,
        "status": record.get("status", "queued"),
        "lane": job.get("lane"),
        "created_ms": job.get("created_ms"),
        "deadline_ms": job.get("deadline_ms"),
    }
    if "result" in record:
        fields.update(json.loads(record["result"]))
    if "error" in record:
        fields["error"] = json.loads(record["error"])
    return JobResult.model_validate(fields)


def add_event(pipe: aioredis.client.Pipeline, job_id: str, raw: str, *, ttl_s: int = keys.JOB_TTL_S) -> None:
    """Queue one event on a pipeline: XADD to the job's stream first, then PUBLISH it.

    Stream before channel is what lets followers treat the stream as the truth
    (``tidegate.event_feed``).
    """
    pipe.xadd(keys.job_events(job_id), {EVENT_FIELD: raw}, maxlen=keys.EVENTS_MAXLEN,
              approximate=True)
    pipe.expire(keys.job_events(job_id), ttl_s)
    pipe.publish(keys.job_channel(job_id), raw)


def set_status(pipe: aioredis.client.Pipeline, job_id: str, status: str, **fields: str) -> None:
    """Queue a status change (and any result/error JSON fields) on the job's hash."""
    pipe.hset(keys.job_hash(job_id), mapping={"status": status, **fields})


async def last_event_id(redis: aioredis.Redis, job_id: str) -> int:
    """The id of the job's newest stored event (0 if none), to continue the sequence."""
    newest = await redis.xrevrange(keys.job_events(job_id), count=1)
    return int(json.loads(newest[0][1][EVENT_FIELD])["id"]) if newest else 0
