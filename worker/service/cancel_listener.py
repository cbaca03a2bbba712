"""Cancel requests pushed to the worker: a subscription to ``keys.CANCEL_CHANNEL``.

``POST /v1/jobs/{id}/cancel`` flags a running job in its hash and publishes its id on the
channel (one script, ``tidegate.jobstore``). The listener collects the ids; the worker takes them
at each step boundary and stops the jobs it runs. Pub/sub drops what is published while a
subscriber is away, so the listener also sweeps the flags of the worker's jobs: after every
(re)subscription, and every ``sweep_s`` as a backstop. Nothing is polled per job per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tidegate import keys
from tidegate.cancelling import cancel_and_wait
from tidegate.jobstore import cancel_requested
from tidegate.redis_conn import control_pubsub

log = logging.getLogger("tidegate.worker")

RETRY_S = 0.5


class CancelListener:
    def __init__(self, redis: aioredis.Redis, jobs: Callable[[], list[str]], *,
                 sweep_s: float = 5.0) -> None:
        self.redis = redis
        self.jobs = jobs  # the ids of the jobs this worker holds now
        self.sweep_s = sweep_s
        self.ready = asyncio.Event()  # subscribed (the first time): safe to claim jobs
        self._requested: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._sweep_now = asyncio.Event()
        self._stopping = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._listen(), name="cancel-listener"),
                       asyncio.create_task(self._sweep(), name="cancel-sweep")]

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks)

    async def stop(self) -> None:
        # The flag as well as the cancel: redis-py's timeouts can swallow a cancellation
        # (asyncio.wait_for on Python 3.11), and the loops must end all the same.
        self._stopping = True
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    def take(self) -> set[str]:
        """The job ids asked to stop since the last call."""
        taken, self._requested = self._requested, set()
        return taken

    async def _listen(self) -> None:
        while not self._stopping:
            try:
                async with control_pubsub(self.redis) as pubsub:
                    await pubsub.subscribe(keys.CANCEL_CHANNEL)
                    while not self._stopping:
                        msg = await pubsub.get_message(timeout=1.0)
                        if msg is None:
                            continue
                        if msg["type"] == "subscribe":
                            self.ready.set()
                            self._sweep_now.set()  # whatever was sent while we were away
                        elif msg["type"] == "message":
                            self._requested.add(msg["data"])
            except (RedisError, OSError) as exc:
                log.warning("cancel subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(RETRY_S)

    async def _sweep(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.sweep_s):
                    await self._sweep_now.wait()
            self._sweep_now.clear()
            try:
                found = await cancel_requested(self.redis, self.jobs())
            except RedisError as exc:
                log.debug("cancel sweep failed: %s", exc)
                self._sweep_now.set()
                await asyncio.sleep(RETRY_S)
                continue
            # Added after the await: ``take`` may have swapped the set meanwhile.
            self._requested |= found
