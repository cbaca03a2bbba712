"""Jobs of a model no worker serves: rejected at their deadline (``no_worker``), not left queued.

A worker rejects a job whose deadline passed when it reads it; a model with no live worker has
nobody to read its lanes, so the API does it. Every second, for each served model with no live
worker heartbeat naming it, the sweeper reads the entries its workers' consumer group has not
read yet on its lanes and on its departed workers' own streams (prefix routing; the whole
stream if no worker ever joined), and for each whose deadline passed it
rejects the job (only if still queued: one script, ``jobstore.reject_queued``) and deletes the
entry. Every API process runs one; they race harmlessly: the script rejects a job once, and a
worker that claims the job first wins (a rejected job a worker reads later is acked unrun).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from tidegate import keys
from tidegate.cancelling import cancel_and_wait
from tidegate.jobstore import JOB_FIELD, reject_queued
from tidegate.operations.queue_stats import WorkerStats, worker_stats
from tidegate.protocol import now_ms

log = logging.getLogger("tidegate.api")

SWEEP_EVERY_S = 1.0
PAGE = 500  # entries read per XRANGE
MAX_ENTRIES = 5000  # entries looked at per stream per sweep: a bounded pass, the rest next time
REASON = "no_worker"
ENDED = frozenset({"rejected", "done", "error", "missing"})


class NoWorkerSweeper:
    """Rejects the expired jobs of ``models`` (served names, the default first) that no live
    worker serves."""

    def __init__(self, redis: aioredis.Redis, models: Sequence[str], *, partitions: int = 1,
                 rejected_ttl_s: int = 300, every_s: float = SWEEP_EVERY_S,
                 on_workers: Callable[[list[WorkerStats]], None] | None = None):
        self.redis = redis
        # Also shown each pass's live workers (the API's model agreement reads the same scan).
        self.on_workers = on_workers
        self.models = list(models)
        self.partitions = partitions
        self.rejected_ttl_s = rejected_ttl_s
        self.every_s = every_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="no-worker-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.sweep()
            except (RedisError, OSError) as exc:  # the submit path reports the outage
                log.debug("no-worker sweep skipped: %s", exc)

    async def sweep(self) -> int:
        """One pass over the unserved models' lanes; how many jobs this call rejected."""
        workers = await worker_stats(self.redis)
        if self.on_workers is not None:
            self.on_workers(workers)
        # A worker from before models (no "model" in its heartbeat) served the default model.
        served = {w.model if w.model is not None else self.models[0] for w in workers}
        rejected = 0
        for model in self.models:
            if model in served:
                continue
            streams = [keys.lane_stream(model, lane, partition)
                       for lane in keys.LANES for partition in range(self.partitions)]
            # Jobs routed to workers of the model that are all gone since (prefix routing).
            streams += sorted(await self.redis.smembers(keys.routed_streams(model)))
            for stream in streams:
                rejected += await self._sweep_stream(model, stream)
        return rejected

    async def _sweep_stream(self, model: str, stream: str) -> int:
        start = await self._unread_from(stream)
        if start is None:
            return 0
        rejected, seen, now = 0, 0, now_ms()
        while seen < MAX_ENTRIES:
            entries = await self.redis.xrange(stream, min=start, count=PAGE)
            if not entries:
                break
            seen += len(entries)
            for entry_id, fields in entries:
                job_id = _expired_job(fields, now)
                if job_id is None:
                    continue
                outcome = await reject_queued(
                    self.redis, job_id, reason=REASON, ttl_s=self.rejected_ttl_s,
                    message=f"no worker serves model {model!r}; the job's deadline passed "
                            f"while it waited for one")
                rejected += outcome == "ok"
                if outcome == "ok" or outcome in ENDED:  # nobody will run it: nothing for a worker to read
                    await self.redis.xdel(stream, entry_id)
            start = f"({entries[-1][0]}"
        return rejected

    async def _unread_from(self, stream: str) -> str | None:
        """Where the entries no worker read begin (an XRANGE start); None: no stream."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        group = next((g for g in groups if g["name"] == keys.CONSUMER_GROUP), None)
        return "-" if group is None else f"({group['last-delivered-id']}"


def _expired_job(fields: dict[str, str], now: int) -> str | None:
    """The job id of an entry whose deadline passed; None for anything else (a malformed entry
    is left for a worker to answer)."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        job = json.loads(fields[JOB_FIELD])
        if int(job["deadline_ms"]) <= now and keys.is_valid_job_id(job["id"]):
            return str(job["id"])
    return None
