"""A worker's LoRA adapters: loaded at start, on announcement, and on a job's first use.

At start the worker registers its model's configured adapters (``--lora``, a models file's
``loras``) in the model's registry (``tidegate.adapter_registry``) and loads them (a failure
there stops the worker: its operator asked for them), then every other registered adapter (a
failure is logged: an API caller's adapter must not stop a worker). It then listens on
``keys.ADAPTER_CHANNEL``: an announced adapter of its model is loaded and the outcome reported
in ``keys.adapter_loads``, where the API that announced it waits. A job naming an adapter the
engine lacks has it looked up in the registry and loaded first (``ensure``). Loads run in a
thread (``Engine.add_adapter`` reads and checks the files) so the event loop keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Mapping

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from tidegate import adapter_registry, keys
from tidegate.adapter_registry import AdapterAnnouncement
from tidegate.cancelling import cancel_and_wait
from tidegate.redis_conn import control_pubsub
from tidegate.worker.engine.engine import Engine
from tidegate.worker.service.engine_thread import on_passing_thread

log = logging.getLogger("tidegate.worker")

RETRY_S = 0.5


class AdapterLoadError(Exception):
    """A configured adapter (``--lora``) could not be loaded: the worker cannot start."""


class AdapterLoader:
    def __init__(self, redis: aioredis.Redis, engine: Engine, *, model: str,
                 worker_id: str) -> None:
        self.redis = redis
        self.engine = engine
        self.model = model  # the served name: only its announcements are ours
        self.worker_id = worker_id
        self._loading: dict[str, asyncio.Task[str | None]] = {}  # one load per name at once
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # loads announced, held till done
        self._stopping = False

    async def load_configured(self, loras: Mapping[str, str]) -> None:
        """Register and load the model's configured adapters; ``AdapterLoadError`` names the
        first that fails (or that the registry holds with another path)."""
        for name, path in loras.items():
            earlier = await adapter_registry.register(self.redis, self.model, name, path)
            if earlier is not None:
                raise AdapterLoadError(f"--lora {name}: the registry of {self.model!r} holds "
                                       f"{name!r} from {earlier.path}, not {path}")
            if (problem := await self._load(name, path)) is not None:
                raise AdapterLoadError(f"--lora {name}={path}: {problem}")

    async def load_registered(self) -> None:
        """Load every registered adapter the engine lacks (failures logged, not raised)."""
        for adapter in (await adapter_registry.registered(self.redis, self.model)).values():
            if adapter.name not in self.engine.adapter_names():
                if (problem := await self.load(adapter.name, adapter.path)) is not None:
                    log.warning("adapter %s of %s not loaded: %s", adapter.name, self.model,
                                problem)

    async def ensure(self, name: str) -> tuple[str, str] | None:
        """Have the engine hold adapter ``name`` (loading it from the registry): None, or the
        (code, message) a job naming it is answered with: ``adapter_not_found`` (not in the
        registry) or ``adapter_load_failed``."""
        if name in self.engine.adapter_names():
            return None
        found = (await adapter_registry.registered(self.redis, self.model)).get(name)
        if found is None:
            return "adapter_not_found", f"the model {self.model!r} has no adapter {name!r}"
        problem = await self.load(name, found.path)
        if problem is None:
            return None
        return "adapter_load_failed", f"adapter {name!r} could not be loaded: {problem}"

    async def load(self, name: str, path: str) -> str | None:
        """Load one adapter (concurrent calls for one name share the load): None or why not."""
        task = self._loading.get(name)
        if task is None:
            task = asyncio.create_task(self._load(name, path))
            self._loading[name] = task
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(task)

    async def _load(self, name: str, path: str) -> str | None:
        try:
            # not on the engine's thread: a step need not wait for the files
            await on_passing_thread(self.engine.add_adapter, name, path)
        except Exception as exc:  # noqa: BLE001 - any reason a directory cannot load is the answer
            return str(exc) or type(exc).__name__
        log.info("adapter %s of %s loaded from %s", name, self.model, path)
        return None

    # ------------------------------------------------------------------ announcements

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="adapter-listener")

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._task] if self._task is not None else []

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(*[t for t in (self._task, *self._background) if t is not None])
        self._task = None

    async def _listen(self) -> None:
        while not self._stopping:
            try:
                async with control_pubsub(self.redis) as pubsub:
                    await pubsub.subscribe(keys.ADAPTER_CHANNEL)
                    while not self._stopping:
                        msg = await pubsub.get_message(timeout=1.0)
                        if msg is None:
                            continue
                        if msg["type"] == "subscribe":  # what was announced while we were away
                            self._spawn(self._load_registered_quietly())
                        elif msg["type"] == "message":
                            self._announced(msg["data"])
            except (RedisError, OSError) as exc:
                log.warning("adapter subscription lost (%s); resubscribing", exc)
                await asyncio.sleep(RETRY_S)

    def _announced(self, data: str) -> None:
        try:
            announcement = AdapterAnnouncement.model_validate_json(data)
        except ValidationError:
            log.warning("ignored a malformed adapter announcement")
            return
        if announcement.model == self.model:
            self._spawn(self._load_and_report(announcement.name, announcement.path))

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _load_and_report(self, name: str, path: str) -> None:
        problem = await self.load(name, path)
        outcome = "ok" if problem is None else f"error: {problem}"
        key = keys.adapter_loads(self.model)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(key, keys.adapter_load_field(name, self.worker_id), outcome)
            pipe.expire(key, keys.ADAPTER_LOADS_TTL_S)
            await pipe.execute()
        except RedisError as exc:  # the API times out; the registry still holds the adapter
            log.warning("could not report adapter %s: %s", name, exc)

    async def _load_registered_quietly(self) -> None:
        with contextlib.suppress(RedisError):
            await self.load_registered()
