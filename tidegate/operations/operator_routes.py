"""``GET /metrics`` and ``GET /readyz`` for the API and the gateway (the worker has its own port).

Both roles can see the whole queue in Redis, so both export it: per model and lane partition
(labels ``model``, ``lane``, ``partition``) the stream's
length, lag, pending and consumers and the oldest waiting job's age (from XINFO, sampled at
scrape time, as KEDA's redis-streams scaler reads it), and the live workers from their
heartbeats. A process adds its own gauges through ``extra``. When Redis cannot be read the
scrape still succeeds with ``tidegate_redis_up 0``, so an alert can fire on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.registry import Collector
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response

from tidegate.operations.queue_stats import ROUTED, queue_stats

LANE_LABELS = ("model", "lane", "partition")
# A probe or scrape must answer promptly even while the client's retries wait out an outage.
REDIS_TIMEOUT_S = 2.0


async def metrics_response(redis: aioredis.Redis, partitions: int,
                           extra: Mapping[str, tuple[str, float]] | None = None,
                           collectors: Iterable[Collector] = (),
                           models: Sequence[str] = ()) -> Response:
    """The Prometheus text exposition of the queue (``models``' lanes, and every other model's
    Redis names), plus ``extra`` {name: (help, value)} and what ``collectors`` (a process's own
    counters) report."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    up = Gauge("tidegate_redis_up", "1 if this process could read the queue from Redis.",
               registry=registry)
    for name, (doc, value) in (extra or {}).items():
        Gauge(name, doc, registry=registry).set(value)
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            stats = await queue_stats(redis, partitions, models)
    except (RedisError, OSError, TimeoutError):
        up.set(0)
    else:
        up.set(1)
        gauges = {
            "length": Gauge("tidegate_queue_length", "Entries in the lane stream.",
                            LANE_LABELS, registry=registry),
            "lag": Gauge("tidegate_queue_lag", "Jobs no worker has read yet (consumer-group "
                         "lag: what autoscaling follows).", LANE_LABELS, registry=registry),
            "pending": Gauge("tidegate_queue_pending", "Jobs read by a worker and not yet "
                             "acknowledged.", LANE_LABELS, registry=registry),
            "consumers": Gauge("tidegate_queue_consumers", "Workers in the lane's consumer "
                               "group.", LANE_LABELS, registry=registry),
        }
        oldest = Gauge("tidegate_queue_oldest_waiting_seconds",
                       "Age of the oldest job no worker has read (0 when none waits).",
                       LANE_LABELS, registry=registry)
        for lane in stats.lanes:
            partition = "routed" if lane.partition == ROUTED else str(lane.partition)
            labels = {"model": lane.model, "lane": lane.lane, "partition": partition}
            for field, gauge in gauges.items():
                gauge.labels(**labels).set(getattr(lane, field))
            oldest.labels(**labels).set(lane.oldest_waiting_s or 0.0)
        Gauge("tidegate_workers_live", "Workers whose heartbeat has not expired.",
              registry=registry).set(len(stats.workers))
        Gauge("tidegate_workers_tokens_per_second", "Tokens per second, all live workers.",
              registry=registry).set(stats.tokens_per_s)
        by_model = Gauge("tidegate_model_workers_live", "Live workers serving the model.",
                         ["model"], registry=registry)
        for model in dict.fromkeys(lane.model for lane in stats.lanes):
            by_model.labels(model=model).set(sum(w.model == model for w in stats.workers))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST,
                    headers={"Cache-Control": "no-store"})


async def readiness_response(redis: aioredis.Redis, *, not_ready: str | None = None
                             ) -> JSONResponse:
    """200 ``{"ready": true}`` when Redis answers a PING and ``not_ready`` is None; else 503
    with the reason."""
    reason = not_ready
    if reason is None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await redis.ping()
        except (RedisError, OSError, TimeoutError):
            reason = "Redis is unreachable"
    if reason is not None:
        return JSONResponse({"ready": False, "reason": reason}, 503)
    return JSONResponse({"ready": True, "reason": "ready"})
