"""Stream intake: the worker's side of its model's lane streams and their consumer group.

With prefix routing (``tidegate.routing``) each lane also has a stream of the worker's own,
where the API puts the jobs whose prompts this worker's cache most likely holds; the worker
reads it before the shared lane. Jobs that waited on another worker's stream past the steal
delay are taken by whichever worker has a free seat (``steal``), and entries pending on a
dead worker's stream are reclaimed like the lanes' own.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import NoScriptError, ResponseError

from tidegate import keys
from tidegate.jobstore import JOB_FIELD
from tidegate.protocol import Job
from tidegate.redis_conn import is_cluster


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


# KEYS[1]: another worker's routed stream. ARGV: group, consumer, delay_ms, count. Delivers to
# the consumer up to ``count`` of the entries the group has not read that were added at least
# ``delay_ms`` ago (by the server's clock, which also stamped the entry ids), oldest first:
# atomically, so a job the owner reads meanwhile is never taken twice, and a fresh one never
# early. Returns the entries as XREADGROUP does for one stream.
_STEAL_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local last = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, id
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then id = g[i + 1] end
  end
  if name == ARGV[1] then last = id end
end
if last == nil then return {} end
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[3])
local old = redis.call('XRANGE', KEYS[1], '(' .. last, tostring(cutoff), 'COUNT', ARGV[4])
if #old == 0 then return {} end
local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', #old,
                       'STREAMS', KEYS[1], '>')
return got[1][2]
"""
_STEAL_SHA = hashlib.sha1(_STEAL_LUA.encode()).hexdigest()

# How long the list of the model's routed streams is trusted before it is read again.
ROUTED_LIST_S = 1.0
# On a Redis Cluster, the longest an idle worker's blocking read waits on one of its streams
# before it waits on the next.
CLUSTER_BLOCK_SLICE_MS = 20


class StreamIntake:
    def __init__(
        self, redis: aioredis.Redis, consumer: str, *, model: str, partitions: int = 1,
        lanes: tuple[str, ...] = keys.LANES, routing: bool = False, steal_delay_ms: int = 200,
    ) -> None:
        self.redis = redis
        self.consumer = consumer
        self.model = model  # the served name: only its lanes are read
        self.lanes = lanes
        self.steal_delay_ms = steal_delay_ms
        # This worker's routed streams (prefix routing on), one per lane.
        self.own = {keys.routed_stream(model, lane, consumer): lane
                    for lane in lanes} if routing else {}
        # What it reads, in priority order: per lane its own stream, then the lane's partitions.
        self.streams = [s for lane in lanes for s in (
            ([keys.routed_stream(model, lane, consumer)] if routing else [])
            + [keys.lane_stream(model, lane, p) for p in range(partitions)])]
        self._empty = False  # the last read found nothing
        self.cluster = is_cluster(redis)
        self._turn = 0  # on a cluster: the stream the next blocking read waits on
        self._others: list[str] = []  # other workers' routed streams, interactive lane first
        self._others_at = -ROUTED_LIST_S
        self.taken: Counter[str] = Counter()  # via (routed, shared, stolen, reclaimed) -> jobs

    async def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self.own:  # listed after they exist, so a job routed there finds them
            await self.redis.sadd(keys.routed_streams(self.model), *self.own)

    def _count(self, deliveries: list[Delivery]) -> list[Delivery]:
        for d in deliveries:
            self.taken["routed" if d.stream in self.own else "shared"] += 1
        return deliveries

    async def others(self) -> list[str]:
        """The model's other routed streams (dead workers' too), interactive lane first."""
        if time.monotonic() - self._others_at >= ROUTED_LIST_S:
            members = await self.redis.smembers(keys.routed_streams(self.model))
            rank = {lane: i for i, lane in enumerate(self.lanes)}
            found = [(rank[parts[0]], s) for s in members if s not in self.own
                     and (parts := keys.routed_stream_lane(self.model, s)) and parts[0] in rank]
            self._others = [s for _, s in sorted(found)]
            self._others_at = time.monotonic()
        return self._others

    async def steal(self, count: int) -> list[Delivery]:
        """Up to ``count`` jobs that waited on other workers' streams past the steal delay."""
        got: list[Delivery] = []
        for stream in await self.others():
            if len(got) >= count:
                break
            args = [keys.CONSUMER_GROUP, self.consumer, self.steal_delay_ms, count - len(got)]
            try:
                reply = await self.redis.evalsha(_STEAL_SHA, 1, stream, *args)
            except NoScriptError:
                await self.redis.script_load(_STEAL_LUA)
                reply = await self.redis.evalsha(_STEAL_SHA, 1, stream, *args)
            for message_id, flat in reply or []:
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                got.append(parse_entry(stream, message_id, fields))
        self.taken["stolen"] += len(got)
        return got

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
            if self.cluster:
                # One XREADGROUP may name streams of one slot only: wait on each stream in
                # turn, a short slice each, so a job on any of them waits at most about
                # slice x (streams - 1) for an idle worker.
                stream = self.streams[self._turn % len(self.streams)]
                self._turn += 1
                got = await self._read({stream: ">"}, 1, min(block_ms, CLUSTER_BLOCK_SLICE_MS))
            else:
                got = await self._read({s: ">" for s in self.streams}, 1, block_ms)
        self._empty = not got
        return self._count(got)

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
        return self._count(await self._read({stream: ">"}, count, None))

    async def reclaim(self, count: int, *, min_idle_ms: int) -> list[Delivery]:
        """Take over up to ``count`` entries other workers left pending past ``min_idle_ms``.

        Their owners stopped refreshing them (``touch``): crashed, killed or partitioned away.
        """
        got: list[Delivery] = []
        for stream in [*self.streams, *(await self.others())]:
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
        self.taken["reclaimed"] += len(got)
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
