"""The worker process: intake -> engine -> publisher, plus heartbeat and shutdown.

The engine step runs in a thread (torch releases the GIL) so the event loop keeps serving Redis
while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid

import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError

from tidegate import keys
from tidegate.redis_conn import connect
from tidegate.settings import Settings
from tidegate.tokenizer import Tokenizer
from worker.engine import Engine, EngineConfig, EngineRequest
from worker.intake import Delivery, StreamIntake
from worker.publisher import ActiveJob, EventPublisher

log = logging.getLogger("tidegate.worker")

IDLE_BLOCK_MS = 1000
HEARTBEAT_EVERY_S = 5.0


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerService:
    def __init__(
        self, redis: aioredis.Redis, engine: Engine, *, worker_id: str | None = None,
        partitions: int = 1, ttl_s: int = keys.JOB_TTL_S,
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.worker_id = worker_id or new_worker_id()
        self.intake = StreamIntake(redis, self.worker_id, partitions=partitions)
        self.publisher = EventPublisher(redis, self.intake, self.worker_id, ttl_s=ttl_s)
        self.active: dict[str, ActiveJob] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        await self.intake.ensure_groups()
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("worker %s ready on %d streams", self.worker_id, len(self.intake.streams))
        try:
            while not self._stop.is_set():
                await self._intake()
                if self.engine.has_unfinished():
                    outputs = await asyncio.to_thread(self.engine.step)
                    for job in await self.publisher.publish_step(outputs, self.active):
                        del self.active[job.job.id]
        finally:
            heartbeat.cancel()
            await self.redis.delete(keys.worker_heartbeat(self.worker_id))

    async def _intake(self) -> None:
        seats = self.engine.config.max_num_seqs - self.engine.num_active
        if seats <= 0:
            return
        block_ms = 0 if self.engine.has_unfinished() else IDLE_BLOCK_MS
        for delivery in await self.intake.read(seats, block_ms=block_ms):
            await self._admit(delivery)

    async def _admit(self, delivery: Delivery) -> None:
        job = delivery.job
        if job is None:
            log.warning("malformed job %s on %s: %s", delivery.message_id, delivery.stream,
                        delivery.problem)
            await self.publisher.fail(delivery, code="invalid_job", message=delivery.problem)
            return
        if job.id in self.active:  # the same job delivered twice: the running copy wins
            await self.intake.ack([delivery])
            return
        try:
            prompt_ids = self.tokenizer.encode_prompt(job.prompt, job.messages)
            request = EngineRequest(job.id, prompt_ids, job.sampling, lane=job.lane,
                                    deadline_ms=job.deadline_ms)
            self.engine.check_request(request)
        except ValueError as exc:  # RequestError, or a chat template refusing the messages
            await self.publisher.fail(delivery, code="invalid_request", message=str(exc))
            return
        self.active[job.id] = await self.publisher.start(job, delivery, len(prompt_ids))
        self.engine.add_request(request)

    async def _heartbeat(self) -> None:
        key = keys.worker_heartbeat(self.worker_id)
        while True:
            try:
                await self.redis.set(key, str(self.engine.num_active),
                                     ex=keys.WORKER_HEARTBEAT_TTL_S)
            except RedisError as exc:  # the main loop sees the outage too; keep beating
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_EVERY_S)


async def serve(settings: Settings) -> None:
    """Load the model, join the consumer group and run until SIGTERM/SIGINT."""
    from worker.loader import load_model

    dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
    loaded = load_model(settings.model, device=settings.device, dtype=dtype)
    log.info("loaded %s in %.1fs (%s, %s)", loaded.source.name, loaded.load_s, settings.device,
             next(loaded.model.parameters()).dtype)
    max_len = min(loaded.tokenizer.max_context, loaded.config.max_position_embeddings)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(
        max_model_len=max_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
        block_size=settings.block_size,
        kv_cache_gb=settings.kv_cache_gb,
        kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
        prefix_caching=settings.prefix_caching,
    ))
    print(f"tidegate worker: {engine.kv_spec.describe()}", flush=True)
    redis = connect(settings.redis_url, blocking_ms=IDLE_BLOCK_MS)
    service = WorkerService(redis, engine, partitions=settings.lane_partitions,
                            ttl_s=settings.job_ttl_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    try:
        await service.run()
    finally:
        await redis.aclose()
