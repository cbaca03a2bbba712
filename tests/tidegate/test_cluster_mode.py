"""Cluster mode against a real local Redis Cluster (3 masters, 3 replicas): the URL forms, and
each path a single server runs as one multi-slot script, split by slot there: the event log's
batch write (per job, SPUBLISH, acks per stream), enqueue (job record, then the entry), the
reject and cancel scripts (the line published after the script), live channels on sharded
pub/sub (one connection per shard), and the hub following a job across a failover of the
master that serves its live channel."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio as aioredis
from pydantic import ValidationError

from tests.redis_cluster import ClusterServers
from tests.stack_process import cli
from tidegate import keys
from tidegate.cluster_client import ClusterClient
from tidegate.events.event_hub import EventHub
from tidegate.events.event_log import EventBatch, EventLog, parse_live
from tidegate.events.live_pubsub import ShardedPubSub, live_pubsub
from tidegate.jobstore import claim_many, enqueue, reject_queued, request_cancel
from tidegate.protocol import Job, JobRequest, token_event_json
from tidegate.redis_conn import (
    cluster_nodes,
    connect,
    control_pubsub,
    is_cluster,
    is_cluster_url,
    redacted,
)
from tidegate.settings import Settings


def token(job_id: str, event_id: int, text: str = "x") -> str:
    return token_event_json(event_id, job_id, event_id - 1, text, [event_id])


# ---------------------------------------------------------------- the URL


def test_cluster_urls_name_their_seed_nodes_and_credentials() -> None:
    assert is_cluster_url("redis+cluster://h:7000") and is_cluster_url("REDISS+CLUSTER://h:1")
    assert not is_cluster_url("redis://h:6379/0")
    seeds, options = cluster_nodes("redis+cluster://u:p%40ss@a:7000,b:7001,c/")
    assert seeds == [("a", 7000), ("b", 7001), ("c", 6379)]
    assert options == {"username": "u", "password": "p@ss"}
    assert cluster_nodes("rediss+cluster://:pw@a:1")[1] == {"password": "pw", "ssl": True}
    for bad in ("redis+cluster://", "redis+cluster://a:notaport", "redis+cluster://a:1,,b:2"):
        with pytest.raises(ValueError):
            cluster_nodes(bad)
    assert redacted("redis+cluster://u:secret@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redacted("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def test_only_failures_that_waiting_cures_count_as_transient() -> None:
    from redis.exceptions import (
        ClusterDownError,
        ConnectionError,
        MovedError,
        ResponseError,
        TimeoutError,
        TryAgainError,
    )

    from tidegate.redis_conn import is_transient

    for error in (ConnectionError("refused"), TimeoutError("slow"), ClusterDownError("down"),
                  TryAgainError("again"), MovedError("3999 127.0.0.1:6381")):
        assert is_transient(error), error
    # A refusal of the command itself (a lane key that is not a stream) is not: a worker that
    # retried it would hang silently instead of dying loudly for its supervisor.
    assert not is_transient(ResponseError("WRONGTYPE Operation against a key holding the wrong "
                                          "kind of value"))


def test_a_malformed_cluster_url_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValidationError, match="redis_url"):
        Settings(redis_url="redis+cluster://a:notaport")
    out = cli("queue", "stats", "--redis-url", "redis+cluster://:hunter2@a:notaport", timeout=60)
    assert out.returncode == 2 and "redis" in out.stderr.lower(), out.stderr
    assert "Traceback" not in out.stderr and "hunter2" not in out.stderr


async def test_connect_picks_the_cluster_client_for_a_cluster_url(cluster_url: str,
                                                                   redis_url: str) -> None:
    cluster = connect(cluster_url)
    single = connect(redis_url)
    try:
        assert isinstance(cluster, ClusterClient) and is_cluster(cluster)
        assert is_cluster(cluster.pipeline()) and not is_cluster(single)
        await cluster.set("tidegate:probe:{a}", "1")
        await cluster.set("tidegate:probe:{b}", "2")  # another slot, likely another node
        assert await cluster.get("tidegate:probe:{b}") == "2"
        assert isinstance(live_pubsub(cluster), ShardedPubSub)
        async with control_pubsub(cluster) as pubsub:  # classic, through any one node
            await pubsub.subscribe(keys.CANCEL_CHANNEL)
            assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
            await cluster.publish(keys.CANCEL_CHANNEL, "job-1")  # the cluster broadcasts it
            message = await pubsub.get_message(timeout=2)
            assert message is not None and message["data"] == "job-1"
    finally:
        await cluster.aclose()
        await single.aclose()


# ---------------------------------------------------------------- writes split by slot


async def _subscribed(cluster: aioredis.RedisCluster, channels: set[str]) -> ShardedPubSub:
    pubsub = ShardedPubSub(cluster)
    await pubsub.subscribe(*channels)
    for _ in channels:
        message = await pubsub.get_message(timeout=2)
        assert message is not None and message["type"] == "subscribe"
    return pubsub


async def _lines(pubsub: ShardedPubSub, wait_s: float = 0.5) -> list[tuple[str, int]]:
    got = []
    loop = asyncio.get_running_loop()
    until = loop.time() + wait_s
    while (left := until - loop.time()) > 0:
        message = await pubsub.get_message(timeout=left)
        if message is not None and message["type"] == "message":
            got += [(job, eid) for job, eid, _, _ in parse_live(message["data"])]
    return sorted(got)


async def test_a_batch_is_written_per_slot_published_on_shards_and_acked_after(
        cluster_url: str, redis_cluster: ClusterServers) -> None:
    cluster = connect(cluster_url)
    jobs = [f"job-{n}" for n in range(6)]  # several slots, several masters
    assert len({redis_cluster.master_for_key(keys.job_hash(j)) for j in jobs}) > 1
    stream = keys.lane_stream("m", "interactive")
    await cluster.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    entries = [await cluster.xadd(stream, {"job": "{}"}) for _ in jobs]
    await cluster.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"})
    # The jobs are this worker's, but job-5 was taken over by another worker meanwhile.
    for job in jobs:
        await cluster.hset(keys.job_hash(job), "worker", "w2" if job == "job-5" else "w1")
    channels = {keys.job_live_channel(j) for j in jobs}
    pubsub = await _subscribed(cluster, channels)
    plain = redis.Redis(port=redis_cluster.master_for_key(next(iter(channels))))
    try:
        batch = EventBatch()
        for job, entry in zip(jobs, entries, strict=True):
            batch.own(job)
            for event_id in (1, 2):
                batch.add_event(job, event_id, "token", token(job, event_id))
            batch.set_fields(job, {"status": "done"})
            batch.ack(stream, entry, job)
        log = EventLog(cluster, owner="w1")
        written = await log.write(batch)
        assert written.duplicates == 0 and written.lost == ["job-5"]
        for job in jobs[:5]:
            assert [i for i, _ in await cluster.xrange(keys.job_events(job))] == ["1-0", "2-0"]
            assert await cluster.hget(keys.job_hash(job), "status") == "done"
        assert await cluster.exists(keys.job_events("job-5")) == 0
        assert await _lines(pubsub) == [(j, i) for j in jobs[:5] for i in (1, 2)]
        # Acked: all but the lost job's entry, and the stream trimmed below the pending one.
        pending = await cluster.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10)
        assert [p["message_id"] for p in pending] == [entries[5]]
        # Sharded: classic pub/sub on the channel's shard carries nothing.
        assert plain.execute_command("PUBSUB", "NUMSUB", next(iter(channels)))[1] == 0
        assert plain.execute_command("PUBSUB", "SHARDNUMSUB", next(iter(channels)))[1] == 1
        # Written again (a retry) plus one new event: only that one is stored and published.
        batch.add_event("job-0", 3, "token", token("job-0", 3))
        again = await log.write(batch)
        assert again.duplicates == 10 and await _lines(pubsub) == [("job-0", 3)]
    finally:
        plain.close()
        await pubsub.aclose()
        await cluster.aclose()


def _job(n: int) -> Job:
    return JobRequest(prompt=f"hello {n}", max_tokens=4).to_job(
        model="m", default_timeout_s=60, job_id=f"job-{n}")


async def test_enqueue_writes_the_record_then_the_entry_on_its_own_slot(
        cluster_url: str) -> None:
    cluster = connect(cluster_url)
    try:
        job = _job(1)
        assert await enqueue(cluster, job) == 1
        assert await cluster.hget(keys.job_hash(job.id), "status") == "queued"
        lane = keys.lane_stream(job.model, job.lane)
        [(_, fields)] = await cluster.xrange(lane)
        assert json.loads(fields["job"])["id"] == job.id
        assert await enqueue(cluster, job) == 0  # a repeat queues nothing
        assert await cluster.xlen(lane) == 1
        # Routed: to the worker's own stream while it exists, else the lane.
        routed = keys.routed_stream(job.model, job.lane, "w1")
        assert await enqueue(cluster, _job(2), routed_to="w1") == 1
        await cluster.xgroup_create(routed, keys.CONSUMER_GROUP, id="0", mkstream=True)
        assert await enqueue(cluster, _job(3), routed_to="w1") == 2
        assert await cluster.xlen(routed) == 1 and await cluster.xlen(lane) == 2
        # Claims run per job in one pipeline (EVALSHA routed by the job's slot).
        claims = await claim_many(cluster, [("job-1", 1), ("job-2", 1), ("nope", 1)], "w9")
        assert [c.before for c in claims] == ["queued", "queued", "missing"]
    finally:
        await cluster.aclose()


async def test_reject_and_cancel_publish_their_event_on_the_jobs_shard(cluster_url: str) -> None:
    cluster = connect(cluster_url)
    try:
        for n in (4, 5):
            assert await enqueue(cluster, _job(n)) == 1
        pubsub = await _subscribed(cluster, {keys.job_live_channel(f"job-{n}") for n in (4, 5)})
        assert await reject_queued(cluster, "job-4", reason="overloaded", message="busy") == "ok"
        assert await request_cancel(cluster, "job-5") == "cancelled"
        assert await _lines(pubsub) == [("job-4", 2), ("job-5", 2)]
        assert await reject_queued(cluster, "job-4", reason="x", message="y") == "rejected"
        assert await cluster.hget(keys.job_hash("job-5"), "status") == "done"
        await pubsub.aclose()
    finally:
        await cluster.aclose()


# ---------------------------------------------------------------- the hub across a failover


async def test_the_hub_follows_a_job_across_a_failover_of_its_channels_master(
        cluster_url: str, redis_cluster: ClusterServers) -> None:
    seeds = ",".join(f"{h}:{p}" for h, p in redis_cluster.startup_nodes)
    cluster = connect(f"redis+cluster://{seeds}")
    writer = connect(f"redis+cluster://{seeds}")
    hub = EventHub(cluster, poll_s=0.5)
    await hub.start()
    job = "job-failover"
    log = EventLog(writer)
    try:
        async with hub.watch(job) as watch:
            for event_id in (1, 2):
                batch = EventBatch()
                batch.add_event(job, event_id, "token", token(job, event_id))
                await log.write(batch)
            got = [await watch.next(timeout=5) for _ in range(2)]
            assert [e.id for e in got if e is not None] == [1, 2]
            await asyncio.to_thread(redis_cluster.kill_master_of, keys.job_live_channel(job))
            for event_id in (3, 4):  # the writer's client finds the promoted replica itself
                batch = EventBatch()
                batch.add_event(job, event_id, "token", token(job, event_id))
                await log.write(batch)  # (its failed calls retried through the failover)
            later = [await watch.next(timeout=10) for _ in range(2)]
            assert [e.id for e in later if e is not None] == [3, 4]
    finally:
        await hub.stop()
        await cluster.aclose()
        await writer.aclose()


# ---------------------------------------------------------------- lane partitions


async def test_lane_partitions_spread_over_shards_and_every_worker_reads_them_all(
        cluster_url: str, redis_cluster: ClusterServers) -> None:
    from tidegate.worker.service.intake import StreamIntake

    partitions = 3
    streams = [keys.lane_stream("m", "interactive", p) for p in range(partitions)]
    assert len({redis_cluster.master_for_key(s) for s in streams}) > 1
    cluster = connect(cluster_url)
    try:
        workers = [StreamIntake(cluster, f"w{n}", model="m", partitions=partitions)
                   for n in range(2)]
        for intake in workers:
            await intake.ensure_groups()
        jobs = [_job(n) for n in range(12)]
        for job in jobs:
            assert await enqueue(cluster, job, partition=keys.job_partition(
                job.id, partitions)) == 1
        assert sorted([await cluster.xlen(s) for s in streams]) == sorted(
            [sum(keys.job_partition(j.id, partitions) == p for j in jobs)
             for p in range(partitions)])
        assert all([await cluster.xlen(s) for s in streams])  # every partition has jobs
        # Two workers share the group on every partition: together they take each job once.
        taken = [d.job_id for d in await workers[0].read(7, block_ms=0)]
        taken += [d.job_id for d in await workers[1].read(12, block_ms=0)]
        assert sorted(taken) == sorted(j.id for j in jobs)
        # An idle worker waits on each partition in turn: a job on the last one still arrives.
        late = _job(99)
        late_partition = keys.job_partition(late.id, partitions)
        waiter = asyncio.create_task(workers[0].read(1, block_ms=2000))
        await asyncio.sleep(0.1)
        await enqueue(cluster, late, partition=late_partition)
        got = []
        while not got:  # each read waits one slice on one stream (the caller loops)
            got = await waiter if waiter is not None else await workers[0].read(1, block_ms=2000)
            waiter = None
        assert [d.job_id for d in got] == [late.id]
    finally:
        await cluster.aclose()
