"""A snapshot of the queue: per model and lane partition, what waits and what runs; per worker,
the model it serves and its load.

Read from Redis alone (XINFO on each lane stream, the workers' heartbeat keys), so any process
can answer it: the gateway's live page, the operators' CLI, metrics. The models are the ones
named by the caller, by a lane stream in Redis or by a live worker's heartbeat. Lag is what the consumer
group has not read yet; pending is what workers read and have not acknowledged (running, or
held by a worker that died until it is reclaimed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tidegate import keys

# The ``partition`` of the LaneStats summing a lane's routed streams (prefix routing).
ROUTED = -1


@dataclass(frozen=True, slots=True)
class LaneStats:
    model: str
    lane: str
    partition: int  # ROUTED: the sum over the workers' routed streams of the lane
    stream: str
    length: int  # entries in the stream, acknowledged ones included until it is trimmed
    lag: int  # not yet read by any worker
    pending: int  # read, not yet acknowledged
    consumers: int
    oldest_waiting_s: float | None  # age of the oldest unread job, None when none waits


@dataclass(frozen=True, slots=True)
class WorkerStats:
    worker_id: str
    running: int
    waiting: int
    tokens_per_s: float
    kv_usage: float  # fraction of KV blocks in use
    model: str | None = None  # the served model's name (None: a worker from before models)
    adapters: tuple[str, ...] = ()  # the adapters it can run
    prefix_hit_rate: float = 0.0  # prompt tokens found in its prefix cache, since it started


@dataclass(frozen=True, slots=True)
class QueueStats:
    lanes: list[LaneStats]
    workers: list[WorkerStats]
    taken_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def running(self) -> int:
        return sum(w.running for w in self.workers)

    @property
    def tokens_per_s(self) -> float:
        return round(sum(w.tokens_per_s for w in self.workers), 1)

    def to_dict(self) -> dict:
        return {"lanes": [asdict(lane) for lane in self.lanes],
                "workers": [asdict(w) for w in self.workers],
                "running": self.running, "tokens_per_s": self.tokens_per_s,
                "taken_ms": self.taken_ms}


def _entry_ms(entry_id: str | bytes) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


async def lane_stats(redis: aioredis.Redis, model: str, lane: str,
                     partition: int = 0) -> LaneStats:
    return await _stream_stats(redis, model, lane, partition,
                               keys.lane_stream(model, lane, partition))


async def routed_stats(redis: aioredis.Redis, model: str) -> list[LaneStats]:
    """Per lane, the sum over the workers' routed streams (none: routing never used)."""
    by_lane: dict[str, list[str]] = {}
    for stream in await redis.smembers(keys.routed_streams(model)):
        parts = keys.routed_stream_lane(model, stream)
        if parts is not None:
            by_lane.setdefault(parts[0], []).append(stream)
    out = []
    for lane in keys.LANES:
        parts = [await _stream_stats(redis, model, lane, ROUTED, s)
                 for s in sorted(by_lane.get(lane, []))]
        if parts:
            waiting = [p.oldest_waiting_s for p in parts if p.oldest_waiting_s is not None]
            out.append(LaneStats(
                model, lane, ROUTED, keys.routed_stream(model, lane, "*"),
                sum(p.length for p in parts), sum(p.lag for p in parts),
                sum(p.pending for p in parts), sum(p.consumers for p in parts),
                max(waiting) if waiting else None))
    return out


async def _stream_stats(redis: aioredis.Redis, model: str, lane: str, partition: int,
                        stream: str) -> LaneStats:
    length = int(await redis.xlen(stream))
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such stream yet: nothing was ever submitted to this lane
        groups = []
    group = next((g for g in groups if g["name"] == keys.CONSUMER_GROUP), None)
    if group is None:
        lag, pending, consumers, last = length, 0, 0, "0-0"
    else:
        pending, consumers = int(group["pending"]), int(group["consumers"])
        last = group["last-delivered-id"]
        lag = group.get("lag")
        if lag is None:  # Redis < 7 or unknown after trimming: count what follows, bounded
            lag = len(await redis.xrange(stream, f"({last}", "+", count=10_000))
        lag = int(lag)
    oldest = None
    if lag:
        first = await redis.xrange(stream, f"({last}" if last != "0-0" else "-", "+", count=1)
        if first:
            oldest = max(0.0, round(time.time() - _entry_ms(first[0][0]) / 1000, 3))
    return LaneStats(model, lane, partition, stream, length, lag, pending, consumers, oldest)


async def worker_stats(redis: aioredis.Redis) -> list[WorkerStats]:
    """Every worker whose heartbeat has not expired."""
    names = sorted([k async for k in redis.scan_iter(match=keys.worker_heartbeat("*"), count=500)])
    values = []
    for name in names:  # one GET each: heartbeat keys live in different cluster slots
        values.append(await redis.get(name))
    workers = []
    for name, raw in zip(names, values, strict=True):
        if raw is None:
            continue  # expired between SCAN and GET
        worker_id = name.split("{", 1)[-1].rstrip("}")
        try:
            beat = json.loads(raw)
        except ValueError:
            beat = {}
        if not isinstance(beat, dict):  # an older worker's plain count of running requests
            beat = {"running": beat}
        model = beat.get("model")
        adapters = beat.get("adapters")
        workers.append(WorkerStats(
            worker_id=worker_id, running=int(beat.get("running", 0)),
            waiting=int(beat.get("waiting", 0)),
            tokens_per_s=float(beat.get("tokens_per_s", 0.0)),
            kv_usage=float(beat.get("kv_usage", 0.0)),
            model=model if isinstance(model, str) else None,
            adapters=tuple(a for a in adapters if isinstance(a, str))
            if isinstance(adapters, list) else (),
            prefix_hit_rate=float(beat.get("prefix_hit_rate", 0.0))))
    return workers


async def known_models(redis: aioredis.Redis, models: Sequence[str] = (),
                       workers: Sequence[WorkerStats] = ()) -> list[str]:
    """``models`` (in order), then every other model a lane stream or a worker names."""
    found = dict.fromkeys(models)
    async for name in redis.scan_iter(match=keys.LANE_STREAM_PATTERN, count=500):
        parsed = keys.parse_lane_stream(name.decode() if isinstance(name, bytes) else name)
        if parsed is not None:
            found.setdefault(parsed[0])
    for worker in workers:
        if worker.model is not None:
            found.setdefault(worker.model)
    return list(found)


async def queue_stats(redis: aioredis.Redis, partitions: int = 1,
                      models: Sequence[str] = ()) -> QueueStats:
    """Every model's lanes (``models`` first, then those Redis names) and the live workers."""
    workers = await worker_stats(redis)
    lanes = []
    for model in await known_models(redis, models, workers):
        lanes += [await lane_stats(redis, model, lane, p)
                  for lane in keys.LANES for p in range(partitions)]
        lanes += await routed_stats(redis, model)
    return QueueStats(lanes=lanes, workers=workers)
