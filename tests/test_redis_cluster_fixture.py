"""The Redis Cluster fixture is a real cluster: keys spread over three masters, a SIGKILLed
master's replica takes over with the data, and the killed node comes back as a replica."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from tests.redis_cluster import ClusterServers


def _client(cluster: ClusterServers) -> RedisCluster:
    """A fresh client from the nodes alive now, so it never starts from a killed one."""
    nodes = [ClusterNode(host, port) for host, port in cluster.startup_nodes]
    return RedisCluster(startup_nodes=nodes, decode_responses=True)


def _keys_on_every_master(cluster: ClusterServers) -> dict[int, str]:
    """One key per master, by master port."""
    keys: dict[int, str] = {}
    for i in range(1000):
        keys.setdefault(cluster.master_for_key(f"key:{i}"), f"key:{i}")
        if len(keys) == 3:
            break
    return keys


def _wait_replicated(cluster: ClusterServers, key: str, value: str) -> None:
    """Poll the key's replica (READONLY) until it has the write: a failover may then keep it."""
    (replica,) = cluster.replicas_of(cluster.master_for_key(key))
    client = redis.Redis(port=replica, decode_responses=True)
    client.execute_command("READONLY")
    deadline = time.monotonic() + 10
    while client.get(key) != value:
        assert time.monotonic() < deadline, f"replica {replica} never got {key}"
        time.sleep(0.02)
    client.close()


async def test_keys_spread_over_three_masters(
    cluster_url: str, redis_cluster: ClusterServers
) -> None:
    parts = urlsplit(cluster_url)
    assert parts.scheme == "redis+cluster"
    masters = redis_cluster.masters()
    assert len(masters) == 3
    assert parts.port in {port for port, _, _ in masters}
    assert sum(hi - lo + 1 for _, _, ranges in masters for lo, hi in ranges) == 16384
    assert all(len(redis_cluster.replicas_of(port)) == 1 for port, _, _ in masters)

    rc = RedisCluster(host=parts.hostname, port=parts.port, decode_responses=True)
    keys = _keys_on_every_master(redis_cluster)
    assert len(keys) == 3
    for port, key in keys.items():
        await rc.set(key, str(port))
    for port, key in keys.items():
        assert await rc.get(key) == str(port)
        # The key really lives on that master, not merely somewhere in the cluster.
        direct = redis.Redis(port=port, decode_responses=True)
        assert direct.execute_command("GET", key) == str(port)
        direct.close()
    await rc.aclose()


async def test_failover_keeps_the_key_and_the_killed_node_returns(
    cluster_url: str, redis_cluster: ClusterServers
) -> None:
    rc = _client(redis_cluster)
    await rc.set("job:1", "queued")
    _wait_replicated(redis_cluster, "job:1", "queued")
    (replica,) = redis_cluster.replicas_of(redis_cluster.master_for_key("job:1"))
    await rc.aclose()

    killed = redis_cluster.kill_master_of("job:1")
    assert redis_cluster.master_for_key("job:1") == replica
    assert killed not in {port for port, _, _ in redis_cluster.masters()}
    assert len(redis_cluster.startup_nodes) == 5

    rc = _client(redis_cluster)
    assert await rc.get("job:1") == "queued"
    await rc.set("job:2", "queued")  # the cluster takes writes again, in every slot
    await rc.aclose()

    redis_cluster.restart(killed)
    assert redis_cluster.replicas_of(replica) == [killed]
    assert len(redis_cluster.startup_nodes) == 6
    rc = _client(redis_cluster)
    assert await rc.get("job:1") == "queued"
    assert await rc.get("job:2") == "queued"
    await rc.aclose()


def test_flush_restarts_a_killed_node_and_empties_the_cluster(
    cluster_url: str, redis_cluster: ClusterServers
) -> None:
    client = redis.Redis(port=urlsplit(cluster_url).port, decode_responses=True)
    key = next(f"k:{i}" for i in range(1000)
               if redis_cluster.master_for_key(f"k:{i}") == urlsplit(cluster_url).port)
    client.set(key, "x")
    client.close()
    killed = redis_cluster.kill_master_of(key)

    redis_cluster.flush()
    assert len(redis_cluster.startup_nodes) == 6
    assert killed in {r for port, _, _ in redis_cluster.masters()
                      for r in redis_cluster.replicas_of(port)}
    for port, _, _ in redis_cluster.masters():
        client = redis.Redis(port=port)
        assert client.dbsize() == 0
        client.close()
