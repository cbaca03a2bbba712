"""The API's prefix-aware routing for every served model: one ``PrefixRouter`` per model, a
task keeping each one's view of the workers' announcements fresh, and the count of routes
taken (``tidegate_routed_jobs_total{model, route}``: cached, placed, shared).

Off (``TIDEGATE_PREFIX_ROUTING=false``), every job goes to the shared lane as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator, Sequence

import redis.asyncio as aioredis
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from tidegate.cancelling import cancel_and_wait
from tidegate.operations.metric_doc import MetricDoc
from tidegate.producer.submit.prefix_router import SHARED, PrefixRouter, Route
from tidegate.routing.cache_announcement import ROUTE_REFRESH_S
from tidegate.routing.prefix_hashes import adapter_salt

log = logging.getLogger("tidegate.api")

ROUTES = ("cached", "placed", "shared")
ROUTED_JOBS = MetricDoc(
    "tidegate_routed_jobs", "counter", "Jobs this API process submitted, by where prefix-aware "
    "routing sent them: cached (a worker holding part of the prompt), placed (first sight of "
    "the prefix: the least loaded worker), shared (the shared lane).", ("model", "route"))


class PrefixRouting(Collector):
    def __init__(self, models: Sequence[str], *, enabled: bool = True,
                 refresh_s: float = ROUTE_REFRESH_S) -> None:
        self.enabled = enabled
        self.refresh_s = refresh_s
        self.routers = {model: PrefixRouter() for model in models}
        self.routes: Counter[tuple[str, str]] = Counter()  # (model, route kind) -> jobs
        self._task: asyncio.Task[None] | None = None

    def start(self, redis: aioredis.Redis) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._refresh(redis), name="prefix-routing")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def route(self, model: str, prompt_ids: Sequence[int], adapter: str | None) -> Route:
        """Where ``model``'s job with these prompt tokens goes (the shared lane when off)."""
        router = self.routers.get(model)
        route = SHARED if not self.enabled or router is None else router.route(
            prompt_ids, adapter_salt(adapter))
        self.routes[(model, route.kind)] += 1
        return route

    def fell_back(self, model: str, route: Route) -> None:
        """A routed job went to the shared lane after all (its worker's stream was gone)."""
        self.routes[(model, route.kind)] -= 1
        self.routes[(model, "shared")] += 1

    async def _refresh(self, redis: aioredis.Redis) -> None:
        failing = False
        while True:
            for model, router in self.routers.items():
                try:
                    await router.refresh(redis, model)
                    failing = False
                except RedisError as exc:  # routing goes on from the last view meanwhile
                    if not failing:
                        log.warning("prefix routing: cannot read the routing table (%s)", exc)
                    failing = True
            await asyncio.sleep(self.refresh_s)

    def collect(self) -> Iterator[Metric]:
        family = ROUTED_JOBS.family()
        for model in self.routers:
            for kind in ROUTES:
                family.add_metric([model, kind], self.routes[(model, kind)])
        yield family
