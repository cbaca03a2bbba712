"""The live channels' subscription of one process: classic pub/sub on a single server, sharded
pub/sub (SSUBSCRIBE) per shard on a Redis Cluster.

On a cluster a live channel (``keys.live_channel``: its own hash tag) belongs to the shard
serving its slot; SPUBLISH keeps its traffic on that shard, and a subscriber must hold
a connection to that shard's primary. ``ShardedPubSub`` holds one connection per primary it
needs, each read by its own task into one queue, and offers the three calls the event hub makes
of redis-py's ``PubSub`` (subscribe, unsubscribe, get_message; messages normalised to the
classic ``message``/``subscribe`` types). A connection that fails, or a shard that tells it a
channel's slot moved away (``sunsubscribe`` the hub did not ask for: a failover or a reshard),
surfaces as an error from ``get_message``; the hub then builds a new subscription, which reads
the slot map again (``tidegate.events.event_hub``: what was missed meanwhile is in the streams).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tidegate.cancelling import cancel_and_wait
from tidegate.cluster_client import ClusterClient
from tidegate.redis_conn import AnyRedis, node_client

_TYPES = {"smessage": "message", "ssubscribe": "subscribe", "sunsubscribe": "unsubscribe"}


class ShardedPubSub:
    """SSUBSCRIBE to live channels on the cluster shards that own them."""

    def __init__(self, cluster: RedisCluster, *, fresh: bool = False):
        self.cluster = cluster
        self.fresh = fresh  # read the slot map again before the first subscribe
        self._shards: dict[str, tuple[aioredis.Redis, PubSub]] = {}  # node name -> connection
        self._channel_node: dict[str, str] = {}  # subscribed channel -> node name
        self._leaving: set[str] = set()  # channels we asked to leave (their sunsubscribe is ours)
        self._queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []
        self._mapped = False

    async def _shard(self, channel: str) -> tuple[str, PubSub]:
        if not self._mapped:  # a resubscription reads the slot map again (a failover)
            if self.fresh and isinstance(self.cluster, ClusterClient):
                await self.cluster.refresh_slots()
            else:
                await self.cluster.initialize()
            self._mapped = True
        node = self.cluster.get_node_from_key(channel)
        if node is None:
            raise RedisConnectionError(f"no cluster node serves {channel}")
        shard = self._shards.get(node.name)
        if shard is None:
            client = node_client(self.cluster, node.host, node.port)
            pubsub = client.pubsub()
            shard = self._shards[node.name] = (client, pubsub)
            await pubsub.connect()
            self._readers.append(asyncio.create_task(self._read(pubsub),
                                                     name=f"live-shard-{node.name}"))
        return node.name, shard[1]

    async def subscribe(self, *channels: str) -> None:
        for channel in channels:
            name, pubsub = await self._shard(channel)
            self._leaving.discard(channel)
            await pubsub.execute_command("SSUBSCRIBE", channel)
            self._channel_node[channel] = name

    async def unsubscribe(self, *channels: str) -> None:
        for channel in channels:
            name = self._channel_node.pop(channel, None)
            if name is not None and name in self._shards:
                self._leaving.add(channel)
                await self._shards[name][1].execute_command("SUNSUBSCRIBE", channel)

    async def _read(self, pubsub: PubSub) -> None:
        try:
            while True:
                msg = await pubsub.get_message(timeout=1.0)
                if msg is None:
                    continue
                kind = _TYPES.get(msg["type"], msg["type"])
                if kind == "unsubscribe":
                    channel = msg["channel"]
                    if channel in self._leaving:
                        self._leaving.discard(channel)
                        continue
                    if channel in self._channel_node:  # the shard dropped it: slot moved
                        raise RedisConnectionError(f"shard unsubscribed {channel} (slot moved)")
                    continue
                self._queue.put_nowait({**msg, "type": kind})
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, RuntimeError) as exc:
            self._queue.put_nowait(exc)

    async def get_message(self, timeout: float | None = 0.0) -> dict[str, Any] | None:
        try:
            async with asyncio.timeout(timeout):
                item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        await cancel_and_wait(*self._readers)
        self._readers = []
        for client, pubsub in self._shards.values():
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
        self._shards.clear()


def live_pubsub(redis: AnyRedis, *, fresh: bool = False) -> PubSub | ShardedPubSub:
    """The subscription object for live channels: classic on one server, sharded on a cluster
    (``fresh``: after a failure, read the cluster's slot map again first)."""
    if isinstance(redis, RedisCluster):
        return ShardedPubSub(redis, fresh=fresh)
    return redis.pubsub()
