"""A worker's announcements for prefix-aware routing (``tidegate.routing``), beside its steps.

The main loop notes, at step boundaries (the block manager is not touched by a step then), the
newest cached block hashes when the cache changed; the announcer's task writes them with the
worker's load a few times a second while they change, and its record at least every
``ANNOUNCE_REFRESH_S`` so it stays alive. Now and then it also forgets workers whose records
expired long ago: their table fields, and their routed streams once nothing is left on them.
On the way out the worker withdraws its record, so no job is routed to it any more.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from tidegate import keys
from tidegate.routing.cache_announcement import (
    ANNOUNCE_EVERY_S,
    ANNOUNCE_REFRESH_S,
    ANNOUNCE_TTL_S,
    FORGET_AFTER_S,
    MAX_ANNOUNCED_BLOCKS,
    CacheAnnouncement,
    announce,
    read_table,
    withdraw,
)
from tidegate.worker.engine.engine import Engine

log = logging.getLogger("tidegate.worker")

FORGET_EVERY_S = 30.0

# KEYS[1]: a routed stream of a worker long gone. Deleted if nothing is left on it (its
# entries are trimmed as they are acknowledged); the enqueue script then sends jobs a stale
# view still routes there to the shared lane. Returns 1 when it is gone.
_DROP_EMPTY_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 1 end
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
_DROP_EMPTY_SHA = hashlib.sha1(_DROP_EMPTY_LUA.encode()).hexdigest()


class CacheAnnouncer:
    def __init__(self, redis: aioredis.Redis, engine: Engine, *, model: str, worker_id: str,
                 own_streams: list[str], busy: Callable[[], int],
                 finished: Callable[[], int] = lambda: 0) -> None:
        self.redis = redis
        self.engine = engine
        self.model = model
        self.worker_id = worker_id
        self.own_streams = own_streams  # its routed streams: their unread jobs are its queue
        self.busy = busy  # requests running, waiting or claimed by this worker
        self.finished = finished  # jobs it finished so far
        self._done_at = (time.monotonic(), 0)
        self._done_per_s = 0.0
        self._noted_changes = -1
        self._noted_at = -ANNOUNCE_EVERY_S
        self._hashes: bytes = b""
        self._version = 0
        self._written_version = -1
        self._written_at = -ANNOUNCE_REFRESH_S
        self._forgot_at = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    def note(self, *, idle: bool = False) -> None:
        """From the main loop, between steps: take the cache's newest hashes if it changed
        (at most every ``ANNOUNCE_EVERY_S`` while steps run; ``idle``: at once, the last
        steps' blocks are not left unannounced)."""
        blocks = self.engine.blocks
        now = time.monotonic()
        if blocks.changes == self._noted_changes or (
                not idle and now - self._noted_at < ANNOUNCE_EVERY_S):
            return
        self._noted_changes, self._noted_at = blocks.changes, now
        hashes = blocks.recent_hashes(MAX_ANNOUNCED_BLOCKS)
        if hashes != self._hashes:
            self._hashes = hashes
            self._version += 1

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="cache-announcer")

    async def stop(self) -> None:
        """Withdraw the record (best effort: it expires anyway)."""
        try:
            async with asyncio.timeout(2):
                await withdraw(self.redis, self.model, self.worker_id)
        except (RedisError, TimeoutError):
            pass

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(ANNOUNCE_EVERY_S)
            try:
                await self.announce_once()
                if time.monotonic() - self._forgot_at >= FORGET_EVERY_S:
                    self._forgot_at = time.monotonic()
                    await self.forget_departed()
                failing = False
            except RedisError as exc:
                if not failing:
                    log.warning("cache announcement failed: %s", exc)
                failing = True

    async def announce_once(self, *, force: bool = False) -> bool:
        """Write the record (and the hashes, if they changed) when due; True if written."""
        now = time.monotonic()
        changed = self._version != self._written_version
        if not (force or changed or now - self._written_at >= ANNOUNCE_REFRESH_S):
            return False
        version = self._version
        at_ms = int(time.time() * 1000)
        record = CacheAnnouncement(
            worker_id=self.worker_id, block_size=self.engine.blocks.block_size,
            seats=self.engine.config.max_num_seqs, busy=self.busy(),
            queued=await self._queued(), at_ms=at_ms,
            expires_ms=at_ms + int(ANNOUNCE_TTL_S * 1000), version=version,
            done_per_s=round(self._finish_rate(now), 2))
        if await announce(self.redis, self.model, record, self._hashes if changed else None):
            self._written_version, self._written_at = version, now
        else:  # the hashes had expired: a new version, so every API fetches them again
            self._version += 1
        return True

    def _finish_rate(self, now: float) -> float:
        """Jobs finished per second since the last announcement, smoothed over a few."""
        then, done_then = self._done_at
        done = self.finished()
        if now > then:
            rate = (done - done_then) / (now - then)
            self._done_per_s = rate if not self._done_per_s else (
                0.5 * self._done_per_s + 0.5 * rate)
        self._done_at = (now, done)
        return self._done_per_s

    async def _queued(self) -> int:
        """Jobs waiting unread on this worker's own streams (its consumer group's lag)."""
        total = 0
        for stream in self.own_streams:
            try:
                groups = await self.redis.xinfo_groups(stream)
            except ResponseError:  # not there (yet, or again after a Redis restart)
                continue
            for group in groups:
                if group["name"] == keys.CONSUMER_GROUP:
                    total += int(group.get("lag") or 0)
        return total

    async def forget_departed(self) -> list[str]:
        """Delete the routing records expired for ``FORGET_AFTER_S``, and the routed streams
        of workers without a live record once they are empty; the streams dropped."""
        now_ms = int(time.time() * 1000)
        table = await read_table(self.redis, self.model)
        gone = [w for w, r in table.items() if now_ms - r.expires_ms > FORGET_AFTER_S * 1000]
        if gone:
            await self.redis.hdel(keys.routing_table(self.model), *gone)
        live = {w for w, r in table.items() if r.expires_ms > now_ms - FORGET_AFTER_S * 1000}
        dropped = []
        for stream in await self.redis.smembers(keys.routed_streams(self.model)):
            if stream in self.own_streams or any(stream.endswith(f".{w}}}") for w in live):
                continue
            if await self._drop_if_empty(stream):
                await self.redis.srem(keys.routed_streams(self.model), stream)
                dropped.append(stream)
        return dropped

    async def _drop_if_empty(self, stream: str) -> bool:
        try:
            return bool(await self.redis.evalsha(_DROP_EMPTY_SHA, 1, stream))
        except NoScriptError:
            await self.redis.script_load(_DROP_EMPTY_LUA)
            return bool(await self.redis.evalsha(_DROP_EMPTY_SHA, 1, stream))
