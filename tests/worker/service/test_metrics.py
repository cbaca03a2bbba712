"""The worker's status port, scraped the way Prometheus and Kubernetes probes use it: metrics that
add up to what the jobs' results say, every outcome counted, and readiness that follows the
model, Redis and draining."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RedisServer
from tests.metric_reference import assert_documented
from tests.worker.service.test_service import collect, submit, tiny  # noqa: F401 - fixture
from tidegate import keys
from tidegate.jobstore import JOB_FIELD, read_result
from tidegate.operations.status_server import StatusServer
from tidegate.worker.engine.engine import Engine, EngineConfig
from tidegate.worker.models.loaders.loader import LoadedModel
from tidegate.worker.service.metrics import OUTCOMES, WorkerMetrics
from tidegate.worker.service.service import WorkerService


@pytest.fixture
async def served(aredis: aioredis.Redis, tiny: LoadedModel  # noqa: F811
                 ) -> AsyncIterator[tuple[WorkerService, str]]:
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_model_len=256, max_num_seqs=4))
    status = StatusServer("127.0.0.1", 0)
    assert status.start()
    metrics = WorkerMetrics(engine)
    service = WorkerService(aredis, engine, model="random_tiny", worker_id="w-metrics", metrics=metrics,
                            status=status)
    status.registry = metrics.registry
    status.model_loaded = True
    task = asyncio.create_task(service.run())
    yield service, f"http://127.0.0.1:{status.port}"
    service.stop()
    await asyncio.wait_for(task, 10)
    status.stop()


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    async with httpx.AsyncClient() as http:
        r = await http.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert_documented(r.text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


async def get(url: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(f"{url}{path}")


async def test_metrics_add_up_to_the_jobs_results(
        aredis: aioredis.Redis, served: tuple[WorkerService, str]) -> None:
    _, url = served
    shared = "the same long prompt shared by two jobs " * 3
    ran = [await submit(aredis, prompt=shared, max_tokens=6),
           await submit(aredis, prompt=f"job {1}", max_tokens=9)]
    for job_id in ran:
        await collect(aredis, job_id)
    ran.append(await submit(aredis, prompt=shared, max_tokens=4))  # hits the prefix cache
    await collect(aredis, ran[-1])
    # An error (malformed job) and a job past its deadline before it could start.
    await aredis.xadd(keys.lane_stream("random_tiny", "interactive"), {JOB_FIELD: "{not json"})
    late = await submit(aredis, prompt="too late", max_tokens=4, timeout_s=0.001)
    assert (await collect(aredis, late))[-1]["type"] == "rejected"

    results = [await read_result(aredis, j) for j in ran]
    completion = sum(r.usage.completion_tokens for r in results if r is not None)
    prompt = sum(r.usage.prompt_tokens for r in results if r is not None)
    m = await scrape(url)

    def finished(reason: str) -> float:
        return m[("tidegate_requests_finished_total", (("reason", reason),))]

    assert finished("completed") == 3 and finished("deadline_exceeded") == 1
    assert finished("error") >= 1  # the malformed entry (no job id to report it under)
    assert {r for r in OUTCOMES} <= {dict(k[1]).get("reason") for k in m
                                     if k[0] == "tidegate_requests_finished_total"}
    assert m[("tidegate_generation_tokens_total", ())] == completion
    assert m[("tidegate_prompt_tokens_total", ())] == prompt
    for name in ("queue_wait", "time_to_first_token", "e2e_request_latency"):
        assert m[(f"tidegate_{name}_seconds_count", ())] == 3
    assert m[("tidegate_inter_token_latency_seconds_count", ())] == completion - 3
    assert m[("tidegate_prefix_cache_hits_total", ())] > 0
    assert m[("tidegate_prefix_cache_queries_total", ())] >= prompt
    assert 0 <= m[("tidegate_kv_cache_usage_ratio", ())] <= 1
    assert m[("tidegate_requests_running", ())] == 0 == m[("tidegate_requests_waiting", ())]
    assert ("tidegate_num_preemptions_total", ()) in m


async def test_readiness_follows_the_model_redis_and_draining(
        redis_server: RedisServer, served: tuple[WorkerService, str]) -> None:
    service, url = served
    assert (await get(url, "/healthz")).status_code == 200
    async with asyncio.timeout(10):
        while (await get(url, "/readyz")).status_code != 200:
            await asyncio.sleep(0.05)
    redis_server.stop()
    try:
        async with asyncio.timeout(20):
            while (r := await get(url, "/readyz")).status_code != 503:
                await asyncio.sleep(0.1)
        assert r.json() == {"ready": False, "reason": "Redis is unreachable"}
        assert (await get(url, "/healthz")).status_code == 200  # alive all the same
    finally:
        redis_server.start()
    async with asyncio.timeout(30):
        while (await get(url, "/readyz")).status_code != 200:
            await asyncio.sleep(0.1)
    service.stop()
    r = await get(url, "/readyz")
    assert r.status_code == 503 and r.json()["reason"] == "draining"
    assert (await get(url, "/nope")).status_code == 404


async def test_a_loading_worker_is_alive_but_not_ready() -> None:
    status = StatusServer("127.0.0.1", 0)
    assert status.start()
    try:
        url = f"http://127.0.0.1:{status.port}"
        assert (await get(url, "/healthz")).status_code == 200
        r = await get(url, "/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "loading the model"
        # A second server on the same port: a warning, not a crash.
        assert StatusServer("127.0.0.1", status.port).start() is False
    finally:
        status.stop()
