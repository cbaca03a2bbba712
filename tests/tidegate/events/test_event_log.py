"""The event log against a real redis-server: one script stores a batch under its event ids,
updates job hashes, publishes one message per live channel and acks, and a batch written again
stores and publishes nothing twice."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.events.event_feed import stored_events
from tidegate.events.event_log import EventBatch, EventLog, last_event_id, parse_live
from tidegate.protocol import token_event_json


def token(job_id: str, event_id: int, text: str = "x") -> str:
    return token_event_json(event_id, job_id, event_id - 1, text, [event_id])


async def messages(pubsub: aioredis.client.PubSub, wait_s: float = 0.5) -> list[str]:
    """The messages published within ``wait_s``."""
    got: list[str] = []
    loop = asyncio.get_running_loop()
    until = loop.time() + wait_s
    while (left := until - loop.time()) > 0:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
        if msg is not None:
            got.append(msg["data"])
    return got


async def test_a_batch_is_stored_under_its_ids_and_published_once_per_channel(
        aredis: aioredis.Redis) -> None:
    jobs = ["job-a", "job-b"]
    pubsub = aredis.pubsub()
    await pubsub.subscribe(*{keys.job_live_channel(j) for j in jobs})
    await pubsub.get_message(timeout=1)
    batch = EventBatch()
    for job in jobs:
        for event_id in (1, 2):
            batch.add_event(job, event_id, "token", token(job, event_id))
        batch.set_fields(job, {"status": "done", "result": '{"text": "xx"}'})
    log = EventLog(aredis)
    assert (await log.write(batch)).duplicates == 0
    for job in jobs:
        entries = await aredis.xrange(keys.job_events(job))
        assert [entry_id for entry_id, _ in entries] == ["1-0", "2-0"]
        assert [e.id for e in await stored_events(aredis, job, after_id=1)] == [2]
        assert await last_event_id(aredis, job) == 2
        assert await aredis.hget(keys.job_hash(job), "status") == "done"
        assert 0 < await aredis.ttl(keys.job_hash(job)) <= keys.JOB_TTL_S
    live = await messages(pubsub)
    lines = [line for message in live for line in parse_live(message)]
    assert sorted((job, eid) for job, eid, _, _ in lines) == [
        ("job-a", 1), ("job-a", 2), ("job-b", 1), ("job-b", 2)]
    assert len(live) == len({keys.job_live_channel(j) for j in jobs})  # one per channel
    # The same batch again (a retry after a lost reply) and one new event: only that one.
    batch.add_event("job-a", 3, "token", token("job-a", 3, "y"))
    assert (await log.write(batch)).duplicates == 4
    assert [e.id for e in await stored_events(aredis, "job-a")] == [1, 2, 3]
    again = [line for message in await messages(pubsub) for line in parse_live(message)]
    assert [(job, eid) for job, eid, _, _ in again] == [("job-a", 3)]
    await pubsub.aclose()


async def test_acks_follow_the_stored_results(aredis: aioredis.Redis) -> None:
    stream = keys.lane_stream("random_tiny", "interactive")
    await aredis.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    entry = await aredis.xadd(stream, {"job": "{}"})
    await aredis.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"})
    batch = EventBatch()
    batch.add_event("job-c", 1, "token", token("job-c", 1))
    batch.ack(stream, entry)
    await EventLog(aredis).write(batch)
    assert (await aredis.xpending(stream, keys.CONSUMER_GROUP))["pending"] == 0
    # An ack for a group that is gone (Redis lost its data) does not fail the write.
    await aredis.delete(stream)
    batch = EventBatch()
    batch.add_event("job-c", 2, "token", token("job-c", 2))
    batch.ack(stream, entry)
    await asyncio.wait_for(EventLog(aredis).write(batch), 5)
    assert await last_event_id(aredis, "job-c") == 2


async def test_a_worker_that_lost_a_job_writes_nothing_more_of_it(aredis: aioredis.Redis) -> None:
    """Fencing: another worker reclaimed job-d (the claim named it in the hash) while this one
    could not reach Redis; this one's held batch stores, publishes, sets and acks nothing of
    job-d, and says so, while its job-e goes through."""
    stream = keys.lane_stream("random_tiny", "interactive")
    await aredis.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    entries = {job: await aredis.xadd(stream, {"job": "{}"}) for job in ("job-d", "job-e")}
    await aredis.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"})
    await aredis.hset(keys.job_hash("job-d"), mapping={"status": "running", "worker": "w2"})
    await aredis.hset(keys.job_hash("job-e"), mapping={"status": "running", "worker": "w1"})
    pubsub = aredis.pubsub()
    await pubsub.subscribe(*{keys.job_live_channel(j) for j in entries})
    await pubsub.get_message(timeout=1)
    batch = EventBatch()
    for job, entry in entries.items():
        batch.own(job)
        batch.add_event(job, 1, "token", token(job, 1))
        batch.set_fields(job, {"status": "done", "result": '{"text": "x"}'})
        batch.refresh_ttl(job, 60)
        batch.ack(stream, entry, job)
    written = await EventLog(aredis, owner="w1").write(batch)
    assert written.lost == ["job-d"] and written.duplicates == 0
    assert await aredis.xlen(keys.job_events("job-d")) == 0
    assert await aredis.hget(keys.job_hash("job-d"), "status") == "running"
    assert await aredis.ttl(keys.job_hash("job-d")) == -1
    assert await aredis.hget(keys.job_hash("job-e"), "status") == "done"
    pending = await aredis.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10)
    assert [p["message_id"] for p in pending] == [entries["job-d"]]
    live = [line for message in await messages(pubsub) for line in parse_live(message)]
    assert [(job, eid) for job, eid, _, _ in live] == [("job-e", 1)]
    await pubsub.aclose()
