"""Offline batches: OpenAI Batch-style JSONL in, one job per line on the batch lane, JSONL out.

The submitter's side (``tidegate batch submit|status|results|cancel``) lives here; the
orchestration runs in arq jobs (``tidegate.producer.batches.batch_worker``). A batch's records share one hash
tag: its state hash, its input lines, which lines have a job on the lane stream, and each
line's output, written once. Every line's job has a deterministic id (batch id + line index),
so any step can run again after a crash without losing or duplicating a line.

Input line: ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body":
{...}}``: ``method`` and ``url`` are optional; ``body`` holds what ``POST /v1/jobs`` takes
(prompt or messages, sampling fields, ``model`` and ``lora``: a served model, the default when
absent; the batch worker resolves it). Output line (input order): ``{"id", "custom_id", "response":
{"status_code": 200, "body": {text, finish_reason, usage}}, "error": null}``, or
``"response": null`` with ``"error": {"code", "message"}``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError

from tidegate import keys, untrusted_json
from tidegate.jobstore import request_cancel
from tidegate.protocol import JobRequest, now_ms
from tidegate.redis_conn import is_cluster, slot_client

BATCH_TIMEOUT_S = 24 * 3600  # each line's deadline: a batch may wait behind interactive work
MAX_LINES = 100_000
LINE_CHUNK = 500  # lines per Redis round trip


class BatchInputError(ValueError):
    """The file is not a batch: the message names the line and what is wrong."""


@dataclass(frozen=True, slots=True)
class BatchStatus:
    batch_id: str
    status: str  # queued | running | cancelling | completed | cancelled
    total: int
    done: int
    failed: int
    created_ms: int
    completed_ms: int | None

    def to_dict(self) -> dict:
        return {"id": self.batch_id, "status": self.status, "total": self.total,
                "done": self.done, "failed": self.failed, "created_ms": self.created_ms,
                "completed_ms": self.completed_ms}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def line_job_id(batch_id: str, index: int) -> str:
    return f"{batch_id}-{index:06d}"


def parse_lines(text: str) -> list[dict]:
    """Normalised ``{"custom_id", "body"}`` per non-empty line; ``BatchInputError`` on a line
    that is not JSON, lacks a string custom_id or an object body, or repeats a custom_id."""
    lines: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = untrusted_json.parse(raw, root="line")
        except untrusted_json.BadJSON as exc:  # not JSON, too deep, a lone surrogate
            detail = f"not JSON ({exc.reason})" if exc.field == "line" else str(exc)
            raise BatchInputError(f"line {number}: {detail}") from None
        if not isinstance(obj, dict):
            raise BatchInputError(f"line {number}: must be a JSON object")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchInputError(f"line {number}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise BatchInputError(f"line {number}: custom_id {custom_id!r} is repeated")
        seen.add(custom_id)
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BatchInputError(f"line {number}: body must be a JSON object")
        lines.append({"custom_id": custom_id, "body": body})
    if not lines:
        raise BatchInputError("the file holds no lines")
    if len(lines) > MAX_LINES:
        raise BatchInputError(f"{len(lines)} lines: a batch holds at most {MAX_LINES}")
    return lines


def line_request(body: dict) -> JobRequest:
    """The job a line asks for, on the batch lane; raises ``ValidationError``."""
    fields = dict(body)
    fields.setdefault("lane", "batch")
    if "timeout_s" not in fields and "deadline_ms" not in fields:
        fields["timeout_s"] = BATCH_TIMEOUT_S
    return JobRequest.model_validate(fields)


def error_line(batch_id: str, index: int, custom_id: str, code: str, message: str) -> str:
    return json.dumps({"id": line_job_id(batch_id, index), "custom_id": custom_id,
                       "response": None, "error": {"code": code, "message": message}})


async def submit(redis: aioredis.Redis, text: str) -> str:
    """Store the batch and queue its orchestration; returns the batch id. Lines whose body is
    not a valid job get their error output now; the others run."""
    from arq.connections import ArqRedis

    lines = parse_lines(text)
    batch_id = new_batch_id()
    invalid: dict[str, str] = {}
    for index, line in enumerate(lines):
        try:
            line_request(line["body"])
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "body"
            invalid[str(index)] = error_line(batch_id, index, line["custom_id"],
                                             "invalid_request", f"{where}: {first['msg']}")
    ttl = keys.BATCH_TTL_S
    # One MULTI on a single server. A cluster client has no MULTI: the writes (one slot) go as
    # a pipeline; a batch half written by an API that died meanwhile has no arq job, is never
    # answered to its submitter, and expires.
    pipe = redis.pipeline(transaction=not is_cluster(redis))
    for start in range(0, len(lines), LINE_CHUNK):
        pipe.rpush(keys.batch_lines(batch_id),
                   *(json.dumps(x) for x in lines[start:start + LINE_CHUNK]))
    if invalid:
        pipe.hset(keys.batch_results(batch_id), mapping=invalid)
    pipe.hset(keys.batch_hash(batch_id), mapping={
        "status": "queued", "total": len(lines), "failed": len(invalid),
        "created_ms": now_ms(), "cursor": 0})
    for key in (keys.batch_hash(batch_id), keys.batch_lines(batch_id),
                keys.batch_results(batch_id)):
        pipe.expire(key, ttl)
    await pipe.execute()
    job_id = keys.batch_arq_job_id(f"enqueue:{batch_id}")
    if not is_cluster(redis):
        arq = ArqRedis(connection_pool=redis.connection_pool)
        await arq.enqueue_job("batch_enqueue", batch_id, _job_id=job_id,
                              _queue_name=keys.BATCH_ARQ_QUEUE)
        return batch_id
    # arq speaks to one server: the primary of its keys' slot (keys.BATCH_ARQ_TAG).
    arq = await slot_client(redis, keys.BATCH_ARQ_QUEUE, cls=ArqRedis, decode_responses=False)
    try:
        await arq.enqueue_job("batch_enqueue", batch_id, _job_id=job_id,
                              _queue_name=keys.BATCH_ARQ_QUEUE)
    finally:
        await arq.aclose()
    return batch_id


async def status(redis: aioredis.Redis, batch_id: str) -> BatchStatus | None:
    state = await redis.hgetall(keys.batch_hash(batch_id))
    if not state:
        return None
    done = await redis.hlen(keys.batch_results(batch_id))
    completed = state.get("completed_ms")
    return BatchStatus(batch_id, state["status"], int(state["total"]), done,
                       int(state.get("failed", 0)), int(state["created_ms"]),
                       int(completed) if completed else None)


async def results(redis: aioredis.Redis, batch_id: str) -> list[str]:
    """Every output line in input order; the batch must have ended."""
    state = await status(redis, batch_id)
    if state is None:
        raise KeyError(batch_id)
    if state.status not in ("completed", "cancelled"):
        raise RuntimeError(f"batch {batch_id} is {state.status}: {state.done} of "
                           f"{state.total} lines done")
    out: list[str] = []
    for start in range(0, state.total, LINE_CHUNK):
        fields = [str(i) for i in range(start, min(start + LINE_CHUNK, state.total))]
        out += await redis.hmget(keys.batch_results(batch_id), fields)
    missing = [i for i, line in enumerate(out) if line is None]
    if missing:  # cannot happen once ended; say so rather than write a short file
        raise RuntimeError(f"batch {batch_id}: no output for line {missing[0]}")
    return out  # type: ignore[return-value]


async def cancel(redis: aioredis.Redis, batch_id: str) -> BatchStatus | None:
    """Stop queuing the batch's lines and cancel its queued and running jobs; the collector
    records them as cancelled and ends the batch."""
    state = await status(redis, batch_id)
    if state is None or state.status in ("completed", "cancelled"):
        return state
    await redis.hset(keys.batch_hash(batch_id), "status", "cancelling")
    enqueued = await redis.hkeys(keys.batch_enqueued(batch_id))
    for index in enqueued:
        await request_cancel(redis, line_job_id(batch_id, int(index)))
    return await status(redis, batch_id)
