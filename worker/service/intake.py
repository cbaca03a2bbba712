"""Stream intake: the worker's side of its model's lane streams and their consumer group."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from tidegate import keys
from tidegate.jobstore import JOB_FIELD
from tidegate.protocol import Job


@dataclass(frozen=True, slots=True)
class Delivery:
    """One lane-stream entry handed to this worker; ``job`` is None when it is malformed."""

    stream: str
    message_id: str
    job: Job | None
    job_id: str | None  # known even for a malformed job when its JSON carries a usable id
    problem: str = ""
    attempt: int = 1  # how many times the group has delivered this entry, this one included


def parse_entry(stream: str, message_id: str, fields: dict[str, str]) -> Delivery:
    raw = fields.get(JOB_FIELD)
    if raw is None:
        return Delivery(stream, message_id, None, None, f"entry has no '{JOB_FIELD}' field")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return Delivery(stream, message_id, None, None, f"job is not JSON: {exc}")
    job_id = data.get("id") if isinstance(data, dict) else None
    if not (isinstance(job_id, str) and keys.is_valid_job_id(job_id)):
        job_id = None
    try:
        return Delivery(stream, message_id, Job.model_validate(data), job_id)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors()
        )
        return Delivery(stream, message_id, None, job_id, f"invalid job: {reasons}")


class StreamIntake:
    def __init__(
        self, redis: aioredis.Redis, consumer: str, *, model: str, partitions: int = 1,
        lanes: tuple[str, ...] = keys.LANES,
    ) -> None:
        self.redis = redis
        self.consumer = consumer
        self.model = model  # the served name: only its lanes are read
        # Lanes in priority order; each lane may be split into partitions.
        self.streams = [keys.lane_stream(model, lane, p) for lane in lanes
                        for p in range(partitions)]
        self._empty = False  # the last read found nothing

    async def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, count: int, *, block_ms: int) -> list[Delivery]:
        """Up to ``count`` new jobs, higher-priority streams first; block only if none.

        After a read that found the streams empty, the next one blocks at once: jobs that
        trickle in then cost one read each, not a look at every stream first."""
        got: list[Delivery] = []
        if not self._empty or block_ms <= 0:
            for stream in self.streams:
                if len(got) >= count:
                    break
                got += await self._read({stream: ">"}, count - len(got), None)
        if not got and block_ms > 0:
            got = await self._read({s: ">" for s in self.streams}, 1, block_ms)
        self._empty = not got
        return got

    async def _read(
        self, streams: dict[str, str], count: int, block_ms: int | None
    ) -> list[Delivery]:
        reply = await self.redis.xreadgroup(
            keys.CONSUMER_GROUP, self.consumer, streams, count=count, block=block_ms
        )
        return [
            parse_entry(stream, message_id, fields)
            for stream, entries in (reply or [])
            for message_id, fields in entries
        ]

    async def peek(self, stream: str, count: int) -> list[Delivery]:
        """The next ``count`` entries the group has not delivered yet, without taking them."""
        groups = await self.redis.xinfo_groups(stream)
        last = next((g["last-delivered-id"] for g in groups if g["name"] == keys.CONSUMER_GROUP),
                    None)
        if last is None:
            return []
        entries = await self.redis.xrange(stream, min=f"({last}", count=count)
        return [parse_entry(stream, message_id, fields) for message_id, fields in entries]

    async def read_from(self, stream: str, count: int) -> list[Delivery]:
        """Take the next ``count`` undelivered entries of one stream (after a ``peek``)."""
        return await self._read({stream: ">"}, count, None)

    async def reclaim(self, count: int, *, min_idle_ms: int) -> list[Delivery]:
        """Take over up to ``count`` entries other workers left pending past ``min_idle_ms``.

        Their owners stopped refreshing them (``touch``): crashed, killed or partitioned away.
        """
        got: list[Delivery] = []
        for stream in self.streams:
            if len(got) >= count:
                break
            reply = await self.redis.xautoclaim(stream, keys.CONSUMER_GROUP, self.consumer,
                                                min_idle_ms, "0-0", count=count - len(got))
            entries = [(mid, fields) for mid, fields in reply[1]
                       if fields is not None]  # None: deleted from the stream while pending
            if not entries:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for message_id, _ in entries:
                pipe.xpending_range(stream, keys.CONSUMER_GROUP, message_id, message_id, 1)
            for (message_id, fields), info in zip(entries, await pipe.execute(), strict=True):
                attempt = info[0]["times_delivered"] if info else 2
                got.append(replace(parse_entry(stream, message_id, fields), attempt=attempt))
        return got

    async def touch(self, deliveries: list[Delivery]) -> None:
        """Reset the idle time of entries this worker is still running, so nobody reclaims them."""
        await self._claim_to_self(deliveries, idle_ms=None)

    async def release(self, deliveries: list[Delivery], *, idle_ms: int) -> None:
        """Mark entries idle as if abandoned long ago, so another worker reclaims them at once."""
        await self._claim_to_self(deliveries, idle_ms=idle_ms)

    async def _claim_to_self(self, deliveries: list[Delivery], *, idle_ms: int | None) -> None:
        by_stream: dict[str, list[str]] = {}
        for d in deliveries:
            by_stream.setdefault(d.stream, []).append(d.message_id)
        for stream, ids in by_stream.items():
            # JUSTID: re-owning does not count as another delivery.
            await self.redis.xclaim(stream, keys.CONSUMER_GROUP, self.consumer, 0, ids,
                                    idle=idle_ms, justid=True)

    async def ack(self, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.xack(d.stream, keys.CONSUMER_GROUP, d.message_id)
        await pipe.execute()
