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
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response

from tidegate.operations.metric_doc import MetricDoc
from tidegate.operations.queue_stats import ROUTED, queue_stats

LANE_LABELS = ("model", "lane", "partition")
# A probe or scrape must answer promptly even while the client's retries wait out an outage.
REDIS_TIMEOUT_S = 2.0

REDIS_UP = MetricDoc("tidegate_redis_up", "gauge",
                     "1 if this process could read the queue from Redis.")
QUEUE_LENGTH = MetricDoc("tidegate_queue_length", "gauge", "Entries in the lane stream.",
                         LANE_LABELS)
QUEUE_LAG = MetricDoc("tidegate_queue_lag", "gauge", "Jobs no worker has read yet "
                      "(consumer-group lag: what autoscaling follows).", LANE_LABELS)
QUEUE_PENDING = MetricDoc("tidegate_queue_pending", "gauge",
                          "Jobs read by a worker and not yet acknowledged.", LANE_LABELS)
QUEUE_CONSUMERS = MetricDoc("tidegate_queue_consumers", "gauge",
                            "Workers in the lane's consumer group.", LANE_LABELS)
QUEUE_OLDEST = MetricDoc("tidegate_queue_oldest_waiting_seconds", "gauge",
                         "Age of the oldest job no worker has read (0 when none waits).",
                         LANE_LABELS)
WORKERS_LIVE = MetricDoc("tidegate_workers_live", "gauge",
                         "Workers whose heartbeat has not expired.")
WORKERS_TOKENS = MetricDoc("tidegate_workers_tokens_per_second", "gauge",
                           "Tokens per second, all live workers.")
MODEL_WORKERS = MetricDoc("tidegate_model_workers_live", "gauge",
                          "Live workers serving the model.", ("model",))
# What every /metrics of the API and the gateway shows (the queue's families only while Redis
# answers).
QUEUE_METRICS = (REDIS_UP, QUEUE_LENGTH, QUEUE_LAG, QUEUE_PENDING, QUEUE_CONSUMERS, QUEUE_OLDEST,
                 WORKERS_LIVE, WORKERS_TOKENS, MODEL_WORKERS)
_LANE_FIELDS = {"length": QUEUE_LENGTH, "lag": QUEUE_LAG, "pending": QUEUE_PENDING,
                "consumers": QUEUE_CONSUMERS}


async def metrics_response(redis: aioredis.Redis, partitions: int,
                           extra: Mapping[MetricDoc, float] | None = None,
                           collectors: Iterable[Collector] = (),
                           models: Sequence[str] = ()) -> Response:
    """The Prometheus text exposition of the queue (``models``' lanes, and every other model's
    Redis names), plus the gauges ``extra`` {doc: value} and what ``collectors`` (a process's own
    counters) report."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    up = REDIS_UP.gauge(registry)
    for doc, value in (extra or {}).items():
        doc.gauge(registry).set(value)
    try:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            stats = await queue_stats(redis, partitions, models)
    except (RedisError, OSError, TimeoutError):
        up.set(0)
    else:
        up.set(1)
        gauges = {field: doc.gauge(registry) for field, doc in _LANE_FIELDS.items()}
        oldest = QUEUE_OLDEST.gauge(registry)
        for lane in stats.lanes:
            partition = "routed" if lane.partition == ROUTED else str(lane.partition)
            labels = {"model": lane.model, "lane": lane.lane, "partition": partition}
            for field, gauge in gauges.items():
                gauge.labels(**labels).set(getattr(lane, field))
            oldest.labels(**labels).set(lane.oldest_waiting_s or 0.0)
        WORKERS_LIVE.gauge(registry).set(len(stats.workers))
        WORKERS_TOKENS.gauge(registry).set(stats.tokens_per_s)
        by_model = MODEL_WORKERS.gauge(registry)
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
