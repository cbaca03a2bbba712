"""The durable registry of each model's LoRA adapters, in Redis (``keys.adapters(model)``).

An adapter is registered by ``POST /v1/adapters`` or by a worker started with ``--lora``; every
worker of the model loads every registered adapter at start and when one is announced on
``keys.ADAPTER_CHANNEL``. The API reads the registry to refuse jobs naming an unknown adapter
(``AdapterRegistry.names``, cached for ``cache_s``: a burst of submits costs one read a second).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import BaseModel

from tidegate import keys
from tidegate.protocol import now_ms

CACHE_S = 1.0


@dataclass(frozen=True, slots=True)
class Adapter:
    """One registered adapter: its name, the PEFT directory workers load it from, and when."""

    name: str
    path: str
    added_ms: int

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "added_ms": self.added_ms})


class AdapterAnnouncement(BaseModel):
    """The message on ``keys.ADAPTER_CHANNEL``: workers of ``model``, load this adapter now."""

    model: str
    name: str
    path: str


def _parse(name: str, raw: str) -> Adapter | None:
    try:
        value = json.loads(raw)
        return Adapter(name, str(value["path"]), int(value.get("added_ms", 0)))
    except (ValueError, KeyError, TypeError):
        return None  # not ours to repair: an operator sees it in the hash


async def registered(redis: aioredis.Redis, model: str) -> dict[str, Adapter]:
    """Every adapter registered for ``model``, by name."""
    raw = await redis.hgetall(keys.adapters(model))
    found = {name: _parse(name, value) for name, value in raw.items()}
    return {name: a for name, a in sorted(found.items()) if a is not None}


async def register(redis: aioredis.Redis, model: str, name: str, path: str) -> Adapter | None:
    """Add the adapter (kept as it was when already registered with the same path); returns
    the adapter registered under that name before with another path (nothing is changed
    then), else None."""
    adapter = Adapter(name, path, now_ms())
    if await redis.hsetnx(keys.adapters(model), name, adapter.to_json()):
        return None
    raw = await redis.hget(keys.adapters(model), name)
    earlier = _parse(name, raw) if raw is not None else None
    if earlier is None:  # removed (or unreadable) between the two calls: take the name
        await redis.hset(keys.adapters(model), name, adapter.to_json())
        return None
    return None if earlier.path == path else earlier


async def unregister(redis: aioredis.Redis, model: str, name: str, path: str) -> None:
    """Remove the adapter, if it is still registered with ``path``."""
    raw = await redis.hget(keys.adapters(model), name)
    if raw is not None and (found := _parse(name, raw)) is not None and found.path == path:
        await redis.hdel(keys.adapters(model), name)


class AdapterRegistry:
    """The API's cached view of the registry: names per model, at most ``cache_s`` old."""

    def __init__(self, *, cache_s: float = CACHE_S):
        self.cache_s = cache_s
        self._names: dict[str, tuple[frozenset[str], float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def names(self, redis: aioredis.Redis, model: str) -> frozenset[str]:
        """The adapters registered for ``model``; concurrent callers share one read."""
        cached = self._names.get(model)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        async with self._locks.setdefault(model, asyncio.Lock()):
            cached = self._names.get(model)
            if cached is None or cached[1] <= time.monotonic():
                names = frozenset(await redis.hkeys(keys.adapters(model)))
                cached = (names, time.monotonic() + self.cache_s)
                self._names[model] = cached
            return cached[0]

    def forget(self, model: str) -> None:
        """Drop the cached names (after this process changed the registry)."""
        self._names.pop(model, None)
