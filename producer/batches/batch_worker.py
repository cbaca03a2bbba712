"""The batch orchestrator: arq jobs that put a batch's lines on the batch lane and collect them.

``batch_enqueue`` queues each line's job (deterministic id) and records the lane stream entry
after writing it; a rerun (arq retries a job whose worker died) skips recorded lines, so at most
the line in flight at a crash is queued twice, and a job id runs once however often it is
queued (the worker's claim). ``batch_collect`` reads finished jobs, writes each line's output
once, and requeues itself (a new arq job every round, each short) until every line has one.
Each step is short and restartable: killing or restarting ``tidegate batch-worker`` mid-batch
loses and duplicates no line. A line's ``model`` is resolved against the served models (the
batch worker is configured with the same ``--model``/``--models-file`` as the workers); a line
naming no served model ends with the error ``model_not_found``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from arq import worker as arq_worker_module
from arq.connections import ArqRedis, RedisSettings
from arq.worker import Worker, func

from tidegate import keys
from tidegate.jobstore import enqueue
from tidegate.model_files.model_catalog import LoraMismatch, ModelCatalog, ModelNotFound
from tidegate.producer.batches.batch import LINE_CHUNK, error_line, line_job_id, line_request
from tidegate.protocol import now_ms
from tidegate.redis_conn import cluster_nodes, connect, connect_sync, is_cluster_url

log = logging.getLogger("tidegate.batch")

COLLECT_EVERY_S = 1.0
STEP_TIMEOUT_S = 120  # one enqueue pass or collect round; arq retries it after a crash


async def batch_enqueue(ctx: dict[str, Any], batch_id: str) -> int:
    """Queue every line not yet on the lane; returns how many this run queued."""
    redis: aioredis.Redis = ctx["tidegate_redis"]
    catalog: ModelCatalog = ctx["tidegate_catalog"]
    state = await redis.hgetall(keys.batch_hash(batch_id))
    if state and state["status"] == "cancelling":  # cancelled before its lines were queued
        await _next_round(ctx, batch_id, 0)  # (arq runs one job per id: a repeat is a no-op)
        return 0
    if not state or state["status"] in ("cancelled", "completed"):
        return 0
    await redis.hset(keys.batch_hash(batch_id), "status", "running")
    total = int(state["total"])
    queued = 0
    for start in range(int(state.get("cursor", 0)), total, LINE_CHUNK):
        stop = min(start + LINE_CHUNK, total)
        lines = await redis.lrange(keys.batch_lines(batch_id), start, stop - 1)
        fields = [str(i) for i in range(start, stop)]
        recorded = await redis.hmget(keys.batch_enqueued(batch_id), fields)
        invalid = await redis.hmget(keys.batch_results(batch_id), fields)
        for index, raw, seen, bad in zip(range(start, stop), lines, recorded, invalid,
                                         strict=True):
            if seen is not None or bad is not None:
                continue
            if await redis.hget(keys.batch_hash(batch_id), "status") == "cancelling":
                # The collector still has to record every line (as cancelled) and end it.
                await _next_round(ctx, batch_id, 0)
                return queued
            line = json.loads(raw)
            request = line_request(line["body"])
            try:
                choice = catalog.choose(request.model, request.lora)
            except (ModelNotFound, LoraMismatch) as exc:
                await _line_failed(redis, batch_id, index, line["custom_id"], exc)
                continue
            job = request.to_job(model=choice.model.name, adapter=choice.adapter,
                                 default_timeout_s=0, job_id=line_job_id(batch_id, index))
            await enqueue(redis, job,
                          partition=keys.job_partition(job.id, ctx.get("tidegate_partitions", 1)))
            # After the entry: a crash in between queues this one line twice, never zero times.
            await redis.hset(keys.batch_enqueued(batch_id), str(index), job.id)
            queued += 1
        await redis.hset(keys.batch_hash(batch_id), "cursor", stop)
    await redis.expire(keys.batch_enqueued(batch_id), keys.BATCH_TTL_S)
    await _next_round(ctx, batch_id, 0)
    return queued


async def _line_failed(redis: aioredis.Redis, batch_id: str, index: int, custom_id: str,
                       exc: Exception) -> None:
    """A line no served model can run: its error output, written (and counted) once."""
    code = "model_not_found" if isinstance(exc, ModelNotFound) else "invalid_request"
    line = error_line(batch_id, index, custom_id, code, str(exc))
    if await redis.hsetnx(keys.batch_results(batch_id), str(index), line):
        await redis.hincrby(keys.batch_hash(batch_id), "failed", 1)


async def batch_collect(ctx: dict[str, Any], batch_id: str, round_: int) -> int:
    """Write the output of every line whose job ended; end the batch or come back."""
    redis: aioredis.Redis = ctx["tidegate_redis"]
    state = await redis.hgetall(keys.batch_hash(batch_id))
    if not state or state["status"] in ("completed", "cancelled"):
        return 0
    total = int(state["total"])
    cancelling = state["status"] == "cancelling"
    written = failed = 0  # this round's fresh outputs, and how many of them are errors
    for start in range(0, total, LINE_CHUNK):
        fields = [str(i) for i in range(start, min(start + LINE_CHUNK, total))]
        have = await redis.hmget(keys.batch_results(batch_id), fields)
        todo = [int(f) for f, h in zip(fields, have, strict=True) if h is None]
        if not todo:
            continue
        recorded = await redis.hmget(keys.batch_enqueued(batch_id), [str(i) for i in todo])
        pipe = redis.pipeline(transaction=False)
        for index in todo:
            pipe.hmget(keys.job_hash(line_job_id(batch_id, index)), ["status", "result",
                                                                     "error"])
        jobs = await pipe.execute()
        lines = None
        out: dict[str, tuple[str, int]] = {}  # line -> (output, 1 if an error)
        for index, seen, (job_status, result, error) in zip(todo, recorded, jobs, strict=True):
            if job_status in ("done", "error", "rejected"):
                lines = lines or await redis.lrange(keys.batch_lines(batch_id), start,
                                                    start + LINE_CHUNK - 1)
                custom_id = json.loads(lines[index - start])["custom_id"]
                out[str(index)] = _output(batch_id, index, custom_id, job_status, result, error)
            elif cancelling and seen is None and job_status is None:
                lines = lines or await redis.lrange(keys.batch_lines(batch_id), start,
                                                    start + LINE_CHUNK - 1)
                custom_id = json.loads(lines[index - start])["custom_id"]
                out[str(index)] = (error_line(batch_id, index, custom_id, "cancelled",
                                              "the batch was cancelled before this line ran"), 1)
        if out:
            # HSETNX per line: a rerun of this round never writes a line twice, nor counts it.
            pipe = redis.pipeline(transaction=False)
            for field, (value, _) in out.items():
                pipe.hsetnx(keys.batch_results(batch_id), field, value)
            pipe.expire(keys.batch_results(batch_id), keys.BATCH_TTL_S)
            fresh = (await pipe.execute())[:-1]
            written += sum(fresh)
            failed += sum(bad for (_, bad), new in zip(out.values(), fresh, strict=True) if new)
    if failed:
        await redis.hincrby(keys.batch_hash(batch_id), "failed", failed)
    done = await redis.hlen(keys.batch_results(batch_id))
    if done >= total:
        final = "cancelled" if cancelling else "completed"
        await redis.hset(keys.batch_hash(batch_id), mapping={"status": final,
                                                              "completed_ms": now_ms()})
        log.info("batch %s %s: %d lines", batch_id, final, total)
    else:
        await _next_round(ctx, batch_id, round_ + 1)
    return written


def _output(batch_id: str, index: int, custom_id: str, job_status: str, result: str | None,
            error: str | None) -> tuple[str, int]:
    if job_status == "done" and result:
        body = json.loads(result)
        if body.get("finish_reason") == "cancelled":
            return error_line(batch_id, index, custom_id, "cancelled",
                              "the job was cancelled"), 1
        return json.dumps({"id": line_job_id(batch_id, index), "custom_id": custom_id,
                           "response": {"status_code": 200, "body": body},
                           "error": None}), 0
    detail = json.loads(error) if error else {"code": job_status, "message": job_status}
    return error_line(batch_id, index, custom_id, detail.get("code", job_status),
                      detail.get("message", "")), 1


async def _next_round(ctx: dict[str, Any], batch_id: str, round_: int) -> None:
    arq: ArqRedis = ctx["redis"]
    await arq.enqueue_job("batch_collect", batch_id, round_,
                          _job_id=keys.batch_arq_job_id(f"collect:{batch_id}:{round_}"), _defer_by=COLLECT_EVERY_S,
                          _queue_name=keys.BATCH_ARQ_QUEUE)


async def _startup(ctx: dict[str, Any]) -> None:
    ctx["tidegate_redis"] = connect(ctx["tidegate_redis_url"])


async def _shutdown(ctx: dict[str, Any]) -> None:
    await ctx["tidegate_redis"].aclose()


def redis_check(redis_url: str) -> Callable[[], str | None]:
    """Readiness for the batch worker's status port: Redis answers a PING within 2 s."""
    import redis as sync_redis

    client = connect_sync(redis_url, socket_timeout=2, socket_connect_timeout=2)

    def check() -> str | None:
        try:
            client.ping()
        except (sync_redis.RedisError, OSError):
            return "Redis is unreachable"
        return None

    return check


def arq_settings(redis_url: str) -> RedisSettings:
    """Where arq runs: the server, or on a cluster the primary serving arq's slot now
    (``keys.BATCH_ARQ_TAG``; after a failover arq's connection breaks, and the batch worker
    starts again, here, on the new primary)."""
    if not is_cluster_url(redis_url):
        return RedisSettings.from_dsn(redis_url)
    # arq's worker finishes a job with a MULTI that also clears the job from arq's abort set,
    # a fixed key of another slot; tidegate never aborts arq jobs, so that set moves into arq's
    # slot with the rest (arq reads the name from its module at call time).
    arq_worker_module.abort_jobs_ss = keys.BATCH_ARQ_ABORT
    _, options = cluster_nodes(redis_url)
    cluster = connect_sync(redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        node = cluster.get_node_from_key(keys.BATCH_ARQ_QUEUE)
    finally:
        cluster.close()
    return RedisSettings(host=node.host, port=node.port, username=options.get("username"),
                         password=options.get("password"), ssl=bool(options.get("ssl")))


def make_worker(redis_url: str, catalog: ModelCatalog, *, burst: bool = False,
                partitions: int = 1) -> Worker:
    """The arq worker that runs batches (``tidegate batch-worker``) on ``catalog``'s models."""
    return Worker(
        functions=[func(batch_enqueue, timeout=STEP_TIMEOUT_S, max_tries=1000),
                   func(batch_collect, timeout=STEP_TIMEOUT_S, max_tries=1000)],
        queue_name=keys.BATCH_ARQ_QUEUE,
        redis_settings=arq_settings(redis_url),
        on_startup=_startup, on_shutdown=_shutdown,
        ctx={"tidegate_redis_url": redis_url, "tidegate_catalog": catalog,
             "tidegate_partitions": partitions},
        burst=burst, max_jobs=4, keep_result=60, poll_delay=0.2,
        handle_signals=True,
    )
