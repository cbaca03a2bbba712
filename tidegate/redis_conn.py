"""Redis connections: one place that decides timeouts, retries, decoding, and single server
versus Redis Cluster.

A URL ``redis://`` / ``rediss://`` / ``unix://`` names one server (every role works exactly as
it always did). ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster``
for TLS) names a Redis Cluster by one or more of its nodes: every role then uses redis-py's
cluster client, which finds the rest of the cluster, follows slot moves and failovers, and
routes each command by its keys' slot. tidegate's keys carry hash tags (``tidegate.keys``) so
that every script and multi-key command touches one slot; the few paths that a single server
runs in one script are split where ``is_cluster`` says so (by slot; a worker's event write by
primary, ``tidegate.events.event_log``).

Pub/sub on a cluster: live job events use sharded pub/sub (SPUBLISH / SSUBSCRIBE, Redis 7), so
a channel's traffic stays on the shard that owns its slot (``tidegate.events.live_pubsub``);
the few control channels (cancel, adapter loads) stay on classic pub/sub, which the cluster
broadcasts to every node: ``control_pubsub`` subscribes through any one node.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import AskError, ClusterDownError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from tidegate.cluster_client import ClusterClient
from tidegate.redis_cancellation import keep_cancellation

# Every process that talks to Redis through this module: a cancelled task stops at its next
# command on Python 3.11 too.
keep_cancellation()

# The URL schemes that name a cluster, and the per-node scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

# Either client: the cluster client has the same command methods (routed by slot).
AnyRedis = aioredis.Redis | AsyncRedisCluster


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The (host, port) seeds of a ``redis+cluster://`` URL and the per-node connection
    options it names (username, password, TLS). Raises ValueError on a malformed URL."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a cluster URL (expected redis+cluster://host:port): {redacted(url)}")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    options: dict[str, Any] = {}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if password:
            options["password"] = unquote(password)
    if CLUSTER_SCHEMES[scheme.lower()] == "rediss":
        options["ssl"] = True
    seeds: list[tuple[str, int]] = []
    for part in netloc.split(","):
        parts = urlsplit(f"//{part}")
        try:
            port = parts.port or 6379
        except ValueError as exc:
            raise ValueError(f"bad port in cluster URL {redacted(url)}: {exc}") from None
        if not parts.hostname:
            raise ValueError(f"cluster URL names no host: {redacted(url)}")
        seeds.append((parts.hostname, port))
    return seeds, options


def _timeouts(blocking_ms: int) -> dict[str, Any]:
    return {
        "decode_responses": True,
        "socket_connect_timeout": 5,
        "socket_timeout": 10 + blocking_ms / 1000,
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


def connect(url: str, *, blocking_ms: int = 0) -> AnyRedis:
    """An asyncio client that decodes to str and retries briefly across a Redis restart (or, on
    a cluster, a failover).

    ``blocking_ms`` is the longest BLOCK this client will issue, so the socket timeout
    stays above it.
    """
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)
    if is_cluster_url(url):
        seeds, options = cluster_nodes(url)
        # A failover takes the cluster a node timeout or two (seconds): the client retries a
        # command that many times, re-reading the slot map between tries.
        return ClusterClient(
            startup_nodes=[ClusterNode(host, port) for host, port in seeds],
            retry=retry, cluster_error_retry_attempts=8, reinitialize_steps=1,
            **options, **_timeouts(blocking_ms))
    return aioredis.Redis.from_url(url, health_check_interval=30, retry=retry,
                                   **_timeouts(blocking_ms))


def connect_sync(url: str, **options: Any) -> redis.Redis | SyncRedisCluster:
    """A blocking client (launcher checks, arq's health probe): a cluster client for a cluster
    URL. ``options`` override the defaults (timeouts, decoding)."""
    if is_cluster_url(url):
        seeds, auth = cluster_nodes(url)
        from redis.cluster import ClusterNode as SyncClusterNode

        return SyncRedisCluster(startup_nodes=[SyncClusterNode(h, p) for h, p in seeds],
                                retry=SyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 3),
                                **auth, **options)
    return redis.Redis.from_url(url, **options)


def is_transient(error: BaseException) -> bool:
    """A Redis failure that waiting cures: the server or a node unreachable or loading, or a
    cluster mid-failover (down, a slot moving); not a refusal of the command itself."""
    return isinstance(error, (RedisConnectionError, RedisTimeoutError, ClusterDownError,
                              TryAgainError, AskError, SlotNotCoveredError))


def is_cluster(client: object) -> bool:
    """True for a Redis Cluster client (sync or asyncio), a pipeline of one, or a wrapper of
    one that says so (``tidegate_cluster``: the submit path's batching client)."""
    from redis.asyncio.cluster import ClusterPipeline
    from redis.cluster import ClusterPipeline as SyncClusterPipeline

    said = getattr(client, "tidegate_cluster", None)
    if isinstance(said, bool):
        return said
    return isinstance(client, AsyncRedisCluster | SyncRedisCluster | ClusterPipeline
                      | SyncClusterPipeline)


def node_client(cluster: AsyncRedisCluster, host: str, port: int, *,
                cls: type[aioredis.Redis] = aioredis.Redis, **overrides: Any) -> aioredis.Redis:
    """A plain client (of class ``cls``) of one cluster node, with the cluster client's
    connection options (password, TLS, timeouts, decoding) unless ``overrides`` say otherwise:
    for what the cluster client cannot do (pub/sub, arq)."""
    node = cluster.get_node(host=host, port=port) or next(iter(cluster.get_nodes()), None)
    given = node.connection_kwargs if node is not None else {}
    kwargs = {name: given[name] for name in _NODE_OPTIONS if name in given}
    if node is not None and issubclass(node.connection_class, SSLConnection):
        kwargs["ssl"] = True
    kwargs.update(overrides)
    return cls(host=host, port=port, **kwargs)


async def slot_client(cluster: ClusterClient, key: str, *,
                      cls: type[aioredis.Redis] = aioredis.Redis,
                      **overrides: Any) -> aioredis.Redis:
    """A plain client of the primary serving ``key``'s slot now (read from a fresh slot map):
    for a library that needs one connection for keys of one slot (arq's MULTI)."""
    await cluster.refresh_slots()
    node = cluster.get_node_from_key(key)
    if node is None:
        raise RedisConnectionError(f"no cluster node serves {key}")
    return node_client(cluster, node.host, node.port, cls=cls, **overrides)


# The connection options a node client takes over from the cluster client's nodes.
_NODE_OPTIONS = ("username", "password", "decode_responses", "encoding", "encoding_errors",
                 "socket_timeout", "socket_connect_timeout", "retry_on_error", "ssl",
                 "ssl_ca_certs", "ssl_ca_data", "ssl_cert_reqs", "ssl_certfile",
                 "ssl_keyfile", "ssl_check_hostname")


@contextlib.asynccontextmanager
async def control_pubsub(client: AnyRedis) -> AsyncIterator[PubSub]:
    """A classic pub/sub connection for the control channels (cancel, adapter loads), closed
    on leaving the block. A cluster broadcasts a PUBLISH to every node, so any primary of the
    client's slot map serves: a random one spreads the subscribers (a dead one fails this try,
    and the caller's next try picks again, from a map the failure marked stale)."""
    plain: aioredis.Redis | None = None
    if isinstance(client, AsyncRedisCluster):
        await client.initialize()
        primaries = client.get_primaries()
        if not primaries:
            raise RedisConnectionError("the cluster has no reachable primary")
        node = random.choice(primaries)
        plain = node_client(client, node.host, node.port)
    pubsub = (plain or client).pubsub()
    try:
        yield pubsub
    finally:
        for closing in (pubsub, plain):
            if closing is not None:
                with contextlib.suppress(Exception):
                    await closing.aclose()


def redacted(url: str) -> str:
    """The URL with any password replaced, for logs (cluster URLs too)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    netloc, slash, path = rest.partition("/")
    userinfo, host = netloc.rsplit("@", 1)
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}{slash}{path}"
