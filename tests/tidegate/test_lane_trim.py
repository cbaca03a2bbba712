"""Lane streams are trimmed as entries are acknowledged, never below what a consumer group still
needs: a pending entry (a running job, or one a dead worker holds until it is reclaimed) and
every entry not yet delivered survive; XINFO's lag stays known."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.events.event_log import EventBatch, EventLog
from tidegate.jobstore import JOB_FIELD, enqueue
from tidegate.protocol import JobRequest

pytestmark = pytest.mark.timeout(30)

LANE = keys.lane_stream("random_tiny", "interactive")


async def enqueue_jobs(aredis: aioredis.Redis, n: int) -> list[str]:
    ids = []
    for i in range(n):
        job = JobRequest(prompt=f"job {i}", max_tokens=1).to_job(model="random_tiny", default_timeout_s=60)
        await enqueue(aredis, job)
        ids.append(job.id)
    return ids


async def read(aredis: aioredis.Redis, consumer: str, count: int,
               group: str = keys.CONSUMER_GROUP) -> list[str]:
    answer = await aredis.xreadgroup(group, consumer, {LANE: ">"}, count=count)
    return [entry_id for _, entries in answer for entry_id, _ in entries]


async def ack_with_events(aredis: aioredis.Redis, entry_ids: list[str]) -> None:
    """What a worker's write does for finished jobs: their fields, then the acks."""
    batch = EventBatch()
    for entry_id in entry_ids:
        batch.ack(LANE, entry_id)
    await EventLog(aredis).write(batch)


async def lane_ids(aredis: aioredis.Redis) -> list[str]:
    return [entry_id for entry_id, _ in await aredis.xrange(LANE)]


async def test_acked_entries_go_while_pending_and_unread_ones_stay(
    aredis: aioredis.Redis,
) -> None:
    await aredis.xgroup_create(LANE, keys.CONSUMER_GROUP, id="0", mkstream=True)
    await enqueue_jobs(aredis, 6)
    first = await read(aredis, "alive", 3)
    held_by_dead = await read(aredis, "dead", 1)
    everything = await lane_ids(aredis)
    # The oldest pending entry bounds the trim: acks above it leave every entry in place.
    await ack_with_events(aredis, first[1:])
    assert await lane_ids(aredis) == everything
    # The oldest acked: entries below the dead worker's pending one go, it and the unread stay.
    await ack_with_events(aredis, first[:1])
    assert await lane_ids(aredis) == everything[3:]
    (group,) = await aredis.xinfo_groups(LANE)
    assert group["pending"] == 1 and group["lag"] == 2
    # Reclaimed and acked: only the two never delivered remain, and are delivered whole.
    claimed = await aredis.xautoclaim(LANE, keys.CONSUMER_GROUP, "alive", 0, "0-0")
    assert [entry_id for entry_id, _ in claimed[1]] == held_by_dead
    await ack_with_events(aredis, held_by_dead)
    assert await lane_ids(aredis) == everything[4:]
    answer = await aredis.xreadgroup(keys.CONSUMER_GROUP, "late", {LANE: ">"})
    entries = answer[0][1]
    assert [entry_id for entry_id, _ in entries] == everything[4:]
    assert all(JOB_FIELD in fields for _, fields in entries)
    await ack_with_events(aredis, everything[4:])
    assert await aredis.xlen(LANE) == 0


async def test_a_group_that_has_read_less_holds_the_trim_back(aredis: aioredis.Redis) -> None:
    await aredis.xgroup_create(LANE, keys.CONSUMER_GROUP, id="0", mkstream=True)
    await aredis.xgroup_create(LANE, "audit", id="0")
    await enqueue_jobs(aredis, 4)
    taken = await read(aredis, "w", 4)
    await ack_with_events(aredis, taken)
    assert await aredis.xlen(LANE) == 4  # "audit" has delivered nothing yet
    audit = await read(aredis, "a", 2, group="audit")
    await aredis.xack(LANE, "audit", *audit)
    await ack_with_events(aredis, [])  # nothing acked: no trim either
    assert await aredis.xlen(LANE) == 4
    await ack_with_events(aredis, taken[:1])  # an ack (again) trims to what "audit" needs
    assert await lane_ids(aredis) == taken[2:]


async def test_no_consumer_group_yet_nothing_is_trimmed(aredis: aioredis.Redis) -> None:
    await enqueue_jobs(aredis, 3)
    await ack_with_events(aredis, ["0-1"])
    assert await aredis.xlen(LANE) == 3
