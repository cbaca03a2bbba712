"""How job events are stored and published: one script call writes a whole batch.

Storage: every event of job J is an entry of J's event stream (``keys.job_events``) whose entry
id is ``<event id>-0`` and whose one field ``e`` holds the event's JSON. Redis refuses an entry
id at or below the stream's newest, so writing an event twice (a batch re-sent after a Redis
outage, a late write of a worker that was replaced) stores it once; readers resume with a range
read from ``<last id + 1>-0``.

Live: events are published on ``keys.LIVE_SHARDS`` shared channels (``keys.live_channel``), one
message per channel per batch. A message is lines joined by ``\\n``, one event per line:
``<job id> <event id> <type> <event JSON>`` (compact JSON holds no raw newline, and job ids no
space), so a subscriber routes an event without parsing its JSON.

``EventBatch`` collects one write: events, job-hash fields (status, result, error), acks of
lane-stream entries. ``EventLog.write`` runs it as one script: the events are stored, then the
hashes updated, then the new events published (stream before channel: followers treat the
stream as the truth), then the entries acked (never ack what is not stored) and each acked lane
stream trimmed below its consumer groups' oldest unacknowledged entry (``XTRIM MINID``:
acknowledged entries are never needed again, and nothing pending or unread is dropped). A script
touches keys of many jobs, which a single Redis (or fakeredis) allows and a Redis Cluster does
not: there the batch is split by primary in the same order (``EventLog._write_by_node``: one
script per primary over its jobs' slots; SPUBLISH on the shard channels; one script per primary
over its acked streams).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tidegate import keys
from tidegate.redis_conn import is_cluster

EVENT_FIELD = "e"  # the one field of an event stream entry: the event's JSON

_HOLE = "\x00"
# Key names are built in the script from these parts, taken from keys.py's own functions.
_HASH_PREFIX, _HASH_SUFFIX = keys.job_hash(_HOLE).split(_HOLE)
_EVENTS_SUFFIX = keys.job_events(_HOLE).split(_HOLE)[1]

# Trims a lane stream below the oldest entry any of its consumer groups still needs: per group,
# its oldest pending entry, or (none pending) the first after its last-delivered id. Exact MINID
# trimming never removes an entry at or above the bound; it leaves max_deleted_entry_id alone
# (XDEL would not), so XINFO's lag stays known. No group yet: nothing is trimmed.
_TRIM_ACKED_LUA = """
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_below(a, b)
  local ams, aseq = id_parts(a)
  local bms, bseq = id_parts(b)
  return ams < bms or (ams == bms and aseq < bseq)
end
local function trim_acked(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) ~= 'table' or groups.err or #groups == 0 then return end
  local floor = nil
  for _, g in ipairs(groups) do
    local info = {}
    for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
    local need
    if tonumber(info['pending']) > 0 then
      need = redis.call('XPENDING', stream, info['name'])[2]
    else
      local ms, seq = id_parts(info['last-delivered-id'])
      need = string.format('%d-%d', ms, seq + 1)
    end
    if floor == nil or id_below(need, floor) then floor = need end
  end
  redis.call('XTRIM', stream, 'MINID', floor)
end
"""

# A new stream node preallocates 4 KB (Redis 7), so a finished job's stream of a few events
# (queued, then rejected; queued, started, tokens, done) holds mostly empty space for as long as
# it is retained. Rewritten through DUMP and RESTORE its nodes are exactly sized: 4.7 KB -> 1.1 KB
# for two events (benchmarks/results/serving/soak.md). Only short streams: a long one's slack is one
# node in many, not worth copying it. Nothing is appended after a final event (ids at or below
# the last are refused, and RESTORE keeps the last id).
COMPACT_MAX_ENTRIES = 128
COMPACT_LUA = f"""
local function compact(key, ttl_s)
  if redis.call('XLEN', key) > {COMPACT_MAX_ENTRIES} then return end
  local dump = redis.call('DUMP', key)
  if dump then redis.call('RESTORE', key, ttl_s * 1000, dump, 'REPLACE') end
end
"""

# ARGV: hash prefix, hash suffix, events suffix, ttl_s, events maxlen, consumer group, statuses,
# expires, acks, owner, fenced jobs, then (channel, message) pairs.
#   owner, fenced jobs: the writing worker, and the jobs (lines) it writes only while it still
#             owns them: their hash's ``worker`` (set by the claim) must name it. A worker that
#             lost a job (its entry reclaimed by another while it could not reach Redis) writes
#             nothing more of it: no event, no field, no TTL, no ack; the job's id is returned.
#   statuses: lines "job\tfield\tvalue[\tfield\tvalue...]" (values are JSON or plain words: no
#             tab, no newline); each hash also gets its TTL again.
#   expires:  lines "job ttl_s" or "job ttl_s final": the job's hash and event stream get this
#             TTL (after the statuses: the final event's retention wins over the hash's
#             refresh); with "final", a short event stream is compacted (_COMPACT_LUA).
#   acks:     lines "stream\tentry id[\tjob]"; each stream is then trimmed below the oldest
#             entry some consumer group still needs (pending, or not yet delivered).
#   messages: live lines; each line's event is stored first, and only the events stored by
#             this call (not duplicates) are published. The channel "-" publishes nothing: the
#             lines stored are returned instead, for the caller to publish (a cluster, below).
# Returns {the number of events already stored (skipped), the unpublished lines stored (joined
# by newlines), the fenced jobs' ids...}.
_WRITE_LUA = _TRIM_ACKED_LUA + COMPACT_LUA + """
local hp, hs, es, ttl, maxlen, group = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local dup = 0
local lost, lost_ids, unpublished = {}, {}, {}
for job in string.gmatch(ARGV[11], '[^\\n]+') do
  if redis.call('HGET', hp .. job .. hs, 'worker') ~= ARGV[10] then
    lost[job] = true
    lost_ids[#lost_ids + 1] = job
  end
end
for line in string.gmatch(ARGV[7], '[^\\n]+') do
  local f = {}
  for part in string.gmatch(line, '[^\\t]+') do f[#f + 1] = part end
  if not lost[f[1]] then
    local key = hp .. f[1] .. hs
    redis.call('HSET', key, unpack(f, 2))
    redis.call('EXPIRE', key, ttl)
  end
end
for i = 12, #ARGV, 2 do
  local fresh, all = {}, true
  for line in string.gmatch(ARGV[i + 1], '[^\\n]+') do
    local job, id, raw = string.match(line, '^(%S+) (%d+) %S+ (.*)$')
    local ok = false
    if not lost[job] then
      ok = redis.pcall('XADD', hp .. job .. es, 'MAXLEN', '~', maxlen, id .. '-0', 'e', raw)
    end
    if not ok then
      all = false
    elseif type(ok) == 'table' and ok.err then
      dup = dup + 1
      all = false
    else
      fresh[#fresh + 1] = line
    end
  end
  if ARGV[i] == '-' then
    for _, line in ipairs(fresh) do unpublished[#unpublished + 1] = line end
  elseif all then
    redis.call('PUBLISH', ARGV[i], ARGV[i + 1])
  elseif #fresh > 0 then
    redis.call('PUBLISH', ARGV[i], table.concat(fresh, '\\n'))
  end
end
for line in string.gmatch(ARGV[8], '[^\\n]+') do
  local job, t, final = string.match(line, '^(%S+) (%d+) ?(%a*)$')
  if not lost[job] then
    redis.call('EXPIRE', hp .. job .. es, t)
    redis.call('EXPIRE', hp .. job .. hs, t)
    if final == 'final' then compact(hp .. job .. es, t) end
  end
end
local acked = {}
for line in string.gmatch(ARGV[9], '[^\\n]+') do
  local stream, id, job = string.match(line, '^([^\\t]+)\\t([^\\t]+)\\t?(.*)$')
  if not lost[job] then
    redis.pcall('XACK', stream, group, id)
    acked[stream] = true
  end
end
for stream in pairs(acked) do trim_acked(stream) end
return {dup, table.concat(unpublished, '\\n'), unpack(lost_ids)}
"""


# On a cluster: the same script over the keys of several slots of one primary (Redis 7 lets
# a script so flagged touch any of the node's slots; it fails on a key the node does not serve).
_NODE_WRITE_LUA = "#!lua flags=allow-cross-slot-keys\n" + _WRITE_LUA
_NODE_WRITE_SHA = hashlib.sha1(_NODE_WRITE_LUA.encode()).hexdigest()
# Failures of a cluster write's call that mean "the map moved": read it again, send again.
_MOVING = (RedisConnectionError, RedisTimeoutError, ClusterDownError, MovedError, AskError,
           TryAgainError, SlotNotCoveredError, RedisClusterException)
_RETRIES = 8


@dataclass(slots=True)
class _JobPart:
    """One job's share of a batch written on a cluster."""

    statuses: list[str] = field(default_factory=list)
    expires: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    owned: bool = False


def entry_id(event_id: int) -> str:
    """The stream entry id that stores event ``event_id``."""
    return f"{event_id}-0"


def live_line(job_id: str, event_id: int, kind: str, raw: str) -> str:
    return f"{job_id} {event_id} {kind} {raw}"


def parse_live(message: str) -> Iterator[tuple[str, int, str, str]]:
    """(job id, event id, type, event JSON) of each line of a live message."""
    for line in message.split("\n"):
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[1].isdecimal():
            yield parts[0], int(parts[1]), parts[2], parts[3]


@dataclass(slots=True)
class EventBatch:
    """One write's events, job-hash fields and acks, in the order they were added per job."""

    # Live lines per shard (keys.live_shard), in the order they were added.
    lines: list[list[str]] = field(default_factory=lambda: [[] for _ in range(keys.LIVE_SHARDS)])
    statuses: list[str] = field(default_factory=list)
    # (job id, TTL in seconds or None for the log's own: the job is not finished)
    expires: list[tuple[str, int | None]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    # Jobs written only while this worker owns them (see ``_WRITE_LUA``: fenced jobs).
    owned: list[str] = field(default_factory=list)
    events: int = 0

    def add_event(self, job_id: str, event_id: int, kind: str, raw: str,
                  shard: int | None = None) -> None:
        """``shard``: the job's ``keys.live_shard``, when the caller keeps it."""
        self.lines[keys.live_shard(job_id) if shard is None else shard].append(
            live_line(job_id, event_id, kind, raw))
        self.events += 1

    def set_fields(self, job_id: str, fields: dict[str, str]) -> None:
        """HSET on the job's hash (values must hold no tab or newline: JSON or plain words)."""
        parts = [job_id]
        for name, value in fields.items():
            if not value or "\t" in value or "\n" in value:
                raise ValueError(f"job field {name!r} must be non-empty, without tab or newline")
            parts += (name, value)
        self.statuses.append("\t".join(parts))

    def refresh_ttl(self, job_id: str, ttl_s: int | None = None) -> None:
        """Set the TTL of the job's hash and event stream: the log's own (``ttl_s`` None: the
        job is starting), or its final status's retention (``tidegate.retention``) with the
        final event (which also compacts a short event stream)."""
        self.expires.append((job_id, ttl_s))

    def ack(self, stream: str, message_id: str, job_id: str | None = None) -> None:
        """XACK the entry; with ``job_id``, only while the job is still this worker's."""
        self.acks.append(f"{stream}\t{message_id}" if job_id is None
                         else f"{stream}\t{message_id}\t{job_id}")

    def own(self, job_id: str) -> None:
        """Write the job's part of this batch only if the writing worker still owns it."""
        self.owned.append(job_id)

    def __bool__(self) -> bool:
        return bool(self.events or self.statuses or self.expires or self.acks)


@dataclass(frozen=True, slots=True)
class Written:
    """What a write did: events it found stored already, and the owned jobs it did not write
    (another worker owns them now)."""

    duplicates: int
    lost: list[str]


class EventLog:
    """Writes ``EventBatch``es through one registered script; ``owner``: the worker whose
    batches these are (their owned jobs are fenced by it)."""

    def __init__(self, redis: aioredis.Redis, *, ttl_s: int = keys.JOB_TTL_S,
                 maxlen: int = keys.EVENTS_MAXLEN, owner: str = ""):
        self.redis = redis
        self.ttl_s = ttl_s
        self.maxlen = maxlen
        self.owner = owner
        self._script = redis.register_script(_WRITE_LUA)

    async def write(self, batch: EventBatch) -> Written:
        """Store and publish the batch."""
        if batch.owned and not self.owner:
            raise ValueError("a batch with owned jobs needs the log's owner")
        args: list[str | int] = [_HASH_PREFIX, _HASH_SUFFIX, _EVENTS_SUFFIX, self.ttl_s,
                                 self.maxlen, keys.CONSUMER_GROUP, "\n".join(batch.statuses),
                                 "\n".join(f"{job} {self.ttl_s}" if ttl is None
                                           else f"{job} {ttl} final"
                                           for job, ttl in batch.expires),
                                 "\n".join(batch.acks), self.owner or "-",
                                 "\n".join(batch.owned)]
        for shard, lines in enumerate(batch.lines):
            if lines:
                args += (keys.live_channel(shard), "\n".join(lines))
        if is_cluster(self.redis):
            return await self._write_by_node(batch)
        dup, _, *lost = await self._script(args=args)
        return Written(int(dup), [str(job) for job in lost])

    def _head(self) -> list[str | int]:
        return [_HASH_PREFIX, _HASH_SUFFIX, _EVENTS_SUFFIX, self.ttl_s, self.maxlen,
                keys.CONSUMER_GROUP]

    async def _write_by_node(self, batch: EventBatch) -> Written:
        """The batch on a cluster. One script may not touch two primaries, so the batch goes
        in one script per primary, all at once: the parts (events, fields, TTLs, fence) of the
        jobs whose slots it serves (slots of one primary may share a script declared
        ``allow-cross-slot-keys``); then, together, the stored events published with SPUBLISH
        on their shard channels and the acks, one script per primary over the lane streams it
        serves. What the single-server order guarantees holds: nothing is published or acked
        before it is stored; a fenced job's entry is not acked. A node's script costs about what the one script costs a
        single server, so the shards' work adds up instead of multiplying per job."""
        parts: dict[str, _JobPart] = {}
        for line in batch.statuses:
            parts.setdefault(line.split("\t", 1)[0], _JobPart()).statuses.append(line)
        for job, ttl in batch.expires:
            parts.setdefault(job, _JobPart()).expires.append(
                f"{job} {self.ttl_s}" if ttl is None else f"{job} {ttl} final")
        for job in batch.owned:
            parts.setdefault(job, _JobPart()).owned = True
        for lines in batch.lines:
            for line in lines:
                parts.setdefault(line.split(" ", 1)[0], _JobPart()).lines.append(line)

        def jobs_args(group: list[tuple[str, _JobPart]]) -> list[str | int]:
            return [*self._head(), "\n".join(s for _, p in group for s in p.statuses),
                    "\n".join(e for _, p in group for e in p.expires), "",
                    self.owner or "-", "\n".join(job for job, p in group if p.owned),
                    "-", "\n".join(line for _, p in group for line in p.lines)]

        dup, lost = 0, set()
        live: list[list[str]] = [[] for _ in range(keys.LIVE_SHARDS)]
        units = [(keys.job_hash(job), (job, part)) for job, part in parts.items()]
        for found, stored, *lost_jobs in await self._by_node(units, jobs_args):
            dup += int(found)
            lost.update(str(job) for job in lost_jobs)
            for line in filter(None, str(stored).split("\n")):
                live[keys.live_shard(line.split(" ", 1)[0])].append(line)
        acks = []
        for line in batch.acks:
            stream, message_id, *job = line.split("\t")
            if not (job and job[0] in lost):
                acks.append((stream, f"{stream}\t{message_id}"))
        # Both only after the store; between themselves no order matters: one round trip.
        await asyncio.gather(self._publish(live), self._by_node(
            acks, lambda group: [*self._head(), "", "", "\n".join(group), "-", ""]))
        return Written(dup, sorted(lost))

    async def _publish(self, live: list[list[str]]) -> None:
        """SPUBLISH each shard channel's lines (the client sends each node its share)."""
        if any(live):
            pipe = self.redis.pipeline(transaction=False)
            for shard, lines in enumerate(live):
                if lines:
                    pipe.execute_command("SPUBLISH", keys.live_channel(shard), "\n".join(lines))
            await pipe.execute()

    async def _by_node(self, units: list[tuple[str, Any]],
                       args: Callable[[list[Any]], list[str | int]]) -> list[list[object]]:
        """The write script once per primary, over the units whose key it serves (``args``
        makes a script's arguments from its units), all primaries at once. A primary's call
        that failed is sent again, regrouped: after loading the script where a node lost its
        cache (a replica promoted, a restart), or, through a failover or a slot moving, after
        reading the slot map again, a quarter of a second apart; what still fails is raised
        (the worker holds the batch and re-sends it: stored events are never stored twice)."""
        replies: list[list[object]] = []
        todo = units
        if not todo:
            return replies
        for attempt in range(_RETRIES + 1):
            await self.redis.initialize()  # reads the slot map when it was marked stale
            groups: dict[str, tuple[Any, list[tuple[str, Any]]]] = {}
            for key, unit in todo:
                node = self.redis.get_node_from_key(key)
                groups.setdefault(node.name, (node, []))[1].append((key, unit))
            answers = await asyncio.gather(*(
                # One key declared: the node checks it serves that slot before running (a
                # stale map gets MOVED, nothing written); the script checks the others.
                self.redis.execute_command("EVALSHA", _NODE_WRITE_SHA, 1, group[0][0],
                                           *args([u for _, u in group]), target_nodes=node)
                for node, group in groups.values()), return_exceptions=True)
            failed: list[tuple[str, Any]] = []
            error: BaseException | None = None
            for (_, group), answer in zip(groups.values(), answers, strict=True):
                if not isinstance(answer, BaseException):
                    replies.append(answer)
                elif _retryable(answer) and attempt < _RETRIES:
                    failed += group
                    error = answer
                else:
                    raise answer
            if not failed:
                return replies
            if isinstance(error, NoScriptError):
                await self.redis.script_load(_NODE_WRITE_LUA)  # on every primary
            else:
                self.redis.reread_slots()  # before the next try (tidegate.cluster_client)
                await asyncio.sleep(0.25)
            todo = failed
        raise AssertionError("unreachable")


def _retryable(error: BaseException) -> bool:
    """A cluster write's call that failed this way is sent again (``EventLog._by_node``)."""
    return isinstance(error, (NoScriptError, *_MOVING)) or (
        isinstance(error, ResponseError) and "non local key" in str(error))


def add_event(pipe: aioredis.client.Pipeline, job_id: str, raw: str, *,
              ttl_s: int = keys.JOB_TTL_S) -> None:
    """Queue one event on a pipeline as the script would write it: stored under its id, then
    published on its live channel (tests and tools; the worker writes batches)."""
    event = json.loads(raw)
    pipe.xadd(keys.job_events(job_id), {EVENT_FIELD: raw}, id=entry_id(int(event["id"])),
              maxlen=keys.EVENTS_MAXLEN, approximate=True)
    pipe.expire(keys.job_events(job_id), ttl_s)
    # Sharded on a cluster (redis-py's cluster pipeline has no method for it: the command).
    pipe.execute_command("SPUBLISH" if is_cluster(pipe) else "PUBLISH", keys.job_live_channel(
        job_id), live_line(job_id, int(event["id"]), event["type"], raw))


async def write_events(redis: aioredis.Redis, events: list[str], *,
                       ttl_s: int = keys.JOB_TTL_S) -> int:
    """Store and publish event JSONs (``id``, ``type`` and ``job_id`` read from each), in order:
    for writers outside the worker's hot path (tests, tools, rare events)."""
    batch = EventBatch()
    for raw in events:
        event = json.loads(raw)
        batch.add_event(event["job_id"], int(event["id"]), event["type"], raw)
    return (await EventLog(redis, ttl_s=ttl_s).write(batch)).duplicates


async def last_event_id(redis: aioredis.Redis, job_id: str) -> int:
    """The id of the job's newest stored event (0 if none), to continue the sequence."""
    newest = await redis.xrevrange(keys.job_events(job_id), count=1)
    return int(newest[0][0].split("-", 1)[0]) if newest else 0
