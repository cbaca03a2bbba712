"""Producer-side backpressure: refuse a submit while its model's lane backlog is over the limit.

Each model has its own lanes (``keys.lane_stream``), so one model's backlog never refuses
another's jobs. A lane's backlog is, summed over its partitions and its workers' routed streams
(prefix routing), what the workers' consumer group has not read yet (``lag``) plus what it read
but has not acknowledged (``pending``). Readings are
cached per (model, lane) for ``cache_s`` (and counted up by this process's own submits meanwhile), so a
burst of submits costs one XINFO per lane per interval.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tidegate import keys

CACHE_S = 0.2


class LaneFull(Exception):
    """The lane's backlog is at or over ``max_backlog``; try again in ``retry_after_s``."""

    def __init__(self, lane: str, backlog: int, max_backlog: int, retry_after_s: int,
                 model: str = ""):
        of = f" of model {model!r}" if model else ""
        super().__init__(f"lane {lane!r}{of} is full: {backlog} jobs waiting, the limit is "
                         f"{max_backlog}; retry in {retry_after_s} s")
        self.lane, self.backlog, self.max_backlog = lane, backlog, max_backlog
        self.model = model
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Reading:
    backlog: int
    expires_at: float  # time.monotonic()


class LaneBacklog:
    """Each model's lanes' backlogs against one limit, read from Redis at most once per
    ``cache_s``."""

    def __init__(self, *, max_backlog: int, partitions: int = 1, retry_after_s: int = 2,
                 cache_s: float = CACHE_S):
        self.max_backlog = max_backlog
        self.partitions = partitions
        self.retry_after_s = retry_after_s  # what a refused producer is told to wait
        self.cache_s = cache_s
        self._readings: dict[tuple[str, str], _Reading] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def check(self, redis: aioredis.Redis, model: str, lane: str) -> None:
        """``LaneFull`` if one more job would not fit on ``model``'s ``lane``."""
        reading = self._readings.get((model, lane))
        if reading is not None and reading.expires_at > time.monotonic():
            backlog = reading.backlog  # the common case: no lock, no await
        else:
            backlog = await self.backlog(redis, model, lane)
        if backlog >= self.max_backlog:
            raise LaneFull(lane, backlog, self.max_backlog, self.retry_after_s, model)

    def note_enqueued(self, model: str, lane: str) -> None:
        """Count a job this process just enqueued into the cached reading."""
        if (reading := self._readings.get((model, lane))) is not None:
            reading.backlog += 1

    async def backlog(self, redis: aioredis.Redis, model: str, lane: str) -> int:
        """The lane's backlog, at most ``cache_s`` old; concurrent callers share one read."""
        async with self._locks.setdefault((model, lane), asyncio.Lock()):
            reading = self._readings.get((model, lane))
            if reading is None or reading.expires_at <= time.monotonic():
                streams = [keys.lane_stream(model, lane, p) for p in range(self.partitions)]
                # Prefix routing's workers' own streams hold part of the lane's backlog.
                streams += sorted(s for s in await redis.smembers(keys.routed_streams(model))
                                  if (keys.routed_stream_lane(model, s) or ("",))[0] == lane)
                total = sum([await self._stream_backlog(redis, s) for s in streams])
                reading = _Reading(total, time.monotonic() + self.cache_s)
                self._readings[(model, lane)] = reading
            return reading.backlog

    async def _stream_backlog(self, redis: aioredis.Redis, stream: str) -> int:
        try:
            groups = await redis.xinfo_groups(stream)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return 0  # nothing was ever enqueued there
            raise
        group = next((g for g in groups if g["name"] == keys.CONSUMER_GROUP), None)
        if group is None:
            return await redis.xlen(stream)  # no worker has joined yet: everything waits
        lag = group.get("lag")
        if lag is None:  # Redis < 7, or the lag is unknown after trimming: count, bounded
            unread = await redis.xrange(stream, min=f"({group['last-delivered-id']}",
                                        count=self.max_backlog + 1)
            lag = len(unread)
        return int(lag) + int(group["pending"])
