"""A job's durable record in Redis: enqueue, status, result.

The job hash holds ``job`` (the Job JSON), ``status``, ``owner`` (the submitting tenant),
``stream_token_hash``, and when finished ``result`` (text, finish_reason, usage, timings) or
``error`` ({code, message}). Producers write it at submit, workers at start and finish;
everybody reads it through ``read_result``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from tidegate import keys
from tidegate.events.event_log import COMPACT_LUA
from tidegate.protocol import Job, JobResult, QueuedEvent
from tidegate.redis_conn import AnyRedis, is_cluster
from tidegate.retention import Retention


@dataclass(frozen=True, slots=True)
class Claim:
    """A worker's claim on a job: the status it had, the id its next event takes, and how many
    deliveries in a row ended before storing a token (see ``_CLAIM_LUA``)."""

    before: str  # 'queued'/'running': run it; 'cancel_requested' or a final status: don't
    next_event_id: int
    stalls: int = 0


JOB_FIELD = "job"  # the one field of a lane stream entry: the Job's JSON


# KEYS: job hash, job events, lane stream, and optionally a worker's routed stream. ARGV: job
# JSON, queued event JSON, ttl_s, the lane's MAXLEN, then field/value pairs for the job hash
# (owner, stream_token_hash). The entry goes to the routed stream if it exists (its worker
# made it with its consumer group; an empty stream of a worker long gone is deleted, and a
# job routed there by a stale view falls back to the lane). Returns 1 (lane) or 2 (routed),
# or 0 when the job already has a record: its first enqueue wrote the record and the lane entry
# together, so a repeat (a retry after a lost reply, a batch step run again) queues nothing.
# The queued event is the job's event 1, stored as entry 1-0 (event n is entry n-0), and is
# written first: an events stream that somehow exists without its hash fails the script before
# anything is written. The lane entry comes last, so a job visible to workers has its record.
#
# Redis Cluster: the job's keys ({job_id}) and the streams ({model.lane.partition} or
# {model.lane.worker}) lie in other slots, and one script may touch one slot only. There the
# script runs with the job's two keys only (it stops before the XADDs), and once it returned 1
# the entry is added in a second round trip on the stream's slot (``_ROUTE_LUA``, or a plain
# XADD on the lane): the record before the entry, as in one script.
_ENQUEUE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[2], '1-0', 'e', ARGV[2])
redis.call('HSET', KEYS[1], 'job', ARGV[1], 'status', 'queued', unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if not KEYS[3] then return 1 end
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'job', ARGV[1])
  return 2
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'job', ARGV[1])
return 1
"""
_ENQUEUE_SHA = hashlib.sha1(_ENQUEUE_LUA.encode()).hexdigest()

# Cluster only. KEYS: a worker's routed stream. ARGV: the job JSON, the lane's MAXLEN. Adds the
# entry if the stream exists (2), else nothing (0: the caller adds it to the lane).
_ROUTE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'job', ARGV[1])
return 2
"""
_ROUTE_SHA = hashlib.sha1(_ROUTE_LUA.encode()).hexdigest()


async def enqueue(
    redis: aioredis.Redis, job: Job, *, partition: int = 0, ttl_s: int = keys.JOB_TTL_S,
    owner: str | None = None, stream_token_hash: str | None = None,
    routed_to: str | None = None,
) -> int:
    """Record the job and its ``queued`` event, then put it on its lane stream: one script,
    one round trip. False if the job id already had a record (nothing is written again).

    The job's keys share one slot and are written first, so a job visible to workers always
    has its record; the lane stream lives in another slot and is written last (see the Cluster
    note above the script). ``owner`` (the submitting tenant) and ``stream_token_hash`` go
    into the job hash with the rest; the hash and the lane entry carry the same job JSON,
    encoded once. ``routed_to``: the worker whose routed stream should take the entry
    (``tidegate.producer.submit.prefix_router``); the lane takes it if that stream is gone.

    Returns 1 (queued on the lane), 2 (on the worker's routed stream), or 0 (the job id
    already had a record: nothing written).
    """
    raw = job.model_dump_json()
    queued = QueuedEvent(id=1, job_id=job.id, lane=job.lane).model_dump_json()
    args: list[str | int] = [raw, queued, ttl_s, keys.LANE_MAXLEN]
    if owner is not None:
        args += ["owner", owner]
    if stream_token_hash is not None:
        args += ["stream_token_hash", stream_token_hash]
    names = [keys.job_hash(job.id), keys.job_events(job.id),
             keys.lane_stream(job.model, job.lane, partition)]
    if routed_to is not None:
        names.append(keys.routed_stream(job.model, job.lane, routed_to))
    if is_cluster(redis):
        if not int(await run_script(redis, _ENQUEUE_LUA, _ENQUEUE_SHA, names[:2], args)):
            return 0
        if routed_to is not None and int(await run_script(
                redis, _ROUTE_LUA, _ROUTE_SHA, names[3:], [raw, keys.LANE_MAXLEN])):
            return 2
        await redis.xadd(names[2], {JOB_FIELD: raw}, maxlen=keys.LANE_MAXLEN, approximate=True)
        return 1
    return int(await run_script(redis, _ENQUEUE_LUA, _ENQUEUE_SHA, names, args))


async def run_script(redis: AnyRedis, script: str, sha: str, names: list[str],
                     args: list[str | int]) -> object:
    """EVALSHA, loading the script first where the server lacks it (a fresh or flushed Redis,
    a promoted replica: script caches are not replicated)."""
    try:
        return await redis.evalsha(sha, len(names), *names, *args)
    except NoScriptError:
        await redis.script_load(script)  # on a cluster: every primary
        return await redis.evalsha(sha, len(names), *names, *args)


async def read_result(redis: aioredis.Redis, job_id: str) -> JobResult | None:
    """The job's status and, when finished, its result; None for an unknown job."""
    record = await redis.hgetall(keys.job_hash(job_id))
    if not record or "job" not in record:
        return None
    job = json.loads(record["job"])
    fields: dict[str, object] = {
        "id": job_id,
        "status": record.get("status", "queued"),
        "lane": job.get("lane"),
        "model": job.get("model"),
        "adapter": job.get("adapter"),
        "created_ms": job.get("created_ms"),
        "deadline_ms": job.get("deadline_ms"),
    }
    if "result" in record:
        fields.update(json.loads(record["result"]))
    if "error" in record:
        fields["error"] = json.loads(record["error"])
    return JobResult.model_validate(fields)


def set_status(pipe: aioredis.client.Pipeline, job_id: str, status: str, **fields: str) -> None:
    """Queue a status change (and any result/error JSON fields) on the job's hash."""
    pipe.hset(keys.job_hash(job_id), mapping={"status": status, **fields})


# ---------------------------------------------------------------- state changes that must not race
#
# Each script touches one job's keys only (one hash tag, one cluster slot). Event ids continue
# from the newest stored event, so a script's event never collides with a worker's.

_NEXT_ID_LUA = """
local function next_event_id(events)
  local newest = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  if #newest == 0 then return 1 end
  return tonumber(string.match(newest[1][1], '^(%d+)')) + 1
end
"""

# KEYS: job hash, job events. ARGV: worker id, the delivery's number.
# Returns {the status before, the next event id, stalls}: 'queued'/'running' -> the caller runs
# the job (now 'running'); anything else (a final status) -> the caller must not run it. A
# cancel request wins too. ``stalls`` counts the deliveries in a row that ended without storing
# a token (a run that progressed resets it): a job whose worker dies before its first token
# each time is poison, one whose worker dies later is not. The claim notes the last event id,
# so the next claim sees whether a token was stored after it.
_CLAIM_LUA = _NEXT_ID_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
local next_id = next_event_id(KEYS[2])
if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then
  return {'cancel_requested', next_id, 0}
end
if status ~= 'queued' and status ~= 'running' then return {status or 'missing', next_id, 0} end
local stalls = tonumber(redis.call('HGET', KEYS[1], 'stalls') or '0')
if tonumber(ARGV[2]) > 1 then
  local since = redis.call('HGET', KEYS[1], 'claimed_after')
  local progressed = false
  if since then
    local after = redis.call('XRANGE', KEYS[2], (tonumber(since) + 1) .. '-0', '+', 'COUNT', 4)
    for _, entry in ipairs(after) do
      if string.find(entry[2][2], '"type":"token"', 1, true) then progressed = true end
    end
  end
  if progressed then stalls = 0 else stalls = stalls + 1 end
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'stalls', stalls,
           'claimed_after', next_id - 1)
return {status, next_id, stalls}
"""

# KEYS: job hash, job events. ARGV: live channel, ttl_s, now_ms, cancel channel, job id,
# events maxlen.
# A queued job ends here as cancelled (done event stored and published in the live format of
# tidegate.events.event_log), its keys kept ttl_s from now (the cancelled retention); a running one is flagged, and its id pushed to the workers, whose one
# running it stops it within a step. Returns what happened.
_CANCEL_LUA = _NEXT_ID_LUA + COMPACT_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return 'cancelling'
end
if status ~= 'queued' then return status end
local job = cjson.decode(redis.call('HGET', KEYS[1], 'job'))
local waited = tonumber(ARGV[3]) - job['created_ms']
local usage = {prompt_tokens = 0, completion_tokens = 0, total_tokens = 0}
local timings = {queue_ms = waited, ttft_ms = waited, total_ms = waited, decode_tokens_per_s = 0}
local result = {text = '', finish_reason = 'cancelled', usage = usage, timings = timings}
local id = next_event_id(KEYS[2])
local event = {type = 'done', id = id, job_id = job['id'], finish_reason = 'cancelled',
               text = '', usage = usage, timings = timings}
local raw = cjson.encode(event)
redis.call('HSET', KEYS[1], 'status', 'done', 'cancel_requested', '1',
           'result', cjson.encode(result))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], id .. '-0', 'e', raw)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
compact(KEYS[2], tonumber(ARGV[2]))
local line = job['id'] .. ' ' .. id .. ' done ' .. raw
if ARGV[1] == '' then return {'cancelled', line} end
redis.call('PUBLISH', ARGV[1], line)
return 'cancelled'
"""


# KEYS: job hash, job events. ARGV: live channel, ttl_s, reason, message, events maxlen.
# A job still queued ends here as rejected: the rejected event stored and published (as a
# worker's would be), its error stored, its keys kept ttl_s from now (the rejected retention).
# Returns 'ok'; anything else (a worker claimed it, it ended, it expired) is left alone: returns
# its status.
_REJECT_QUEUED_LUA = _NEXT_ID_LUA + COMPACT_LUA + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status ~= 'queued' then return status end
local job = cjson.decode(redis.call('HGET', KEYS[1], 'job'))
local id = next_event_id(KEYS[2])
local raw = cjson.encode({type = 'rejected', id = id, job_id = job['id'], reason = ARGV[3],
                          message = ARGV[4]})
redis.call('HSET', KEYS[1], 'status', 'rejected',
           'error', cjson.encode({code = ARGV[3], message = ARGV[4]}))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], id .. '-0', 'e', raw)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
compact(KEYS[2], tonumber(ARGV[2]))
local line = job['id'] .. ' ' .. id .. ' rejected ' .. raw
if ARGV[1] == '' then return {'ok', line} end
redis.call('PUBLISH', ARGV[1], line)
return 'ok'
"""


async def reject_queued(redis: aioredis.Redis, job_id: str, *, reason: str, message: str,
                        ttl_s: int = Retention().rejected_s) -> str:
    """Reject a job no worker has claimed: 'ok', or the status it had instead ('running', a
    final status ('rejected' included), 'missing'), in which case nothing changed. Safe to race: of several callers
    (API replicas) one rejects it, and a worker that claims it first wins."""
    return await _publishing(redis, _REJECT_QUEUED_LUA, job_id, ttl_s, reason, message,
                             keys.EVENTS_MAXLEN)


async def _publishing(redis: AnyRedis, script: str, job_id: str, *args: str | int) -> str:
    """Run a script of one job that publishes its new event (ARGV[1]: the live channel). A
    script on a cluster may not publish on a channel of another slot, so there it returns
    the event's line and the line goes out here, with SPUBLISH, after the script stored it."""
    names = [keys.job_hash(job_id), keys.job_events(job_id)]
    channel = keys.job_live_channel(job_id)
    if not is_cluster(redis):
        return await redis.eval(script, 2, *names, channel, *args)
    reply = await redis.eval(script, 2, *names, "", *args)
    if isinstance(reply, list):
        reply, line = reply
        await redis.spublish(channel, line)
    return reply


async def claim_many(redis: aioredis.Redis, jobs: list[tuple[str, int]], worker_id: str
                     ) -> list[Claim]:
    """Mark each job running unless it already ended or was cancelled: one round trip.
    ``jobs``: (job id, the delivery's number) pairs."""
    if not jobs:
        return []
    script = redis.register_script(_CLAIM_LUA)  # EVALSHA: the body travels once, if at all
    cluster = is_cluster(redis)
    for attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        for job_id, delivery in jobs:
            names = [keys.job_hash(job_id), keys.job_events(job_id)]
            if cluster:  # redis-py's cluster pipeline has no evalsha method; the command routes
                pipe.execute_command("EVALSHA", script.sha, 2, *names, worker_id, delivery)
            else:
                await script(keys=names, args=[worker_id, delivery], client=pipe)
        try:
            return [Claim(str(before), int(next_id), int(stalls))
                    for before, next_id, stalls in await pipe.execute()]
        except NoScriptError:
            # A pipeline loads its scripts before it runs, but its retry after a dropped
            # connection does not: a Redis restarted meanwhile (its script cache empty)
            # refuses the EVALSHA. Nothing ran (the first command failed); a new pipeline
            # loads the script again. A cluster's pipeline loads nothing: load it on every
            # primary (a claim run twice is harmless: the second sees 'running', its own).
            if attempt:
                raise
            if is_cluster(redis):
                await redis.script_load(_CLAIM_LUA)
    raise AssertionError("unreachable")


async def request_cancel(redis: aioredis.Redis, job_id: str, *,
                         ttl_s: int = Retention().cancelled_s) -> str:
    """Cancel a job: 'cancelled' (it was queued: its keys are kept ``ttl_s`` from now),
    'cancelling' (its worker will stop it), 'missing', or the final status it already had
    ('done', 'error', 'rejected')."""
    from tidegate.protocol import now_ms

    return await _publishing(redis, _CANCEL_LUA, job_id, ttl_s, now_ms(), keys.CANCEL_CHANNEL,
                             job_id, keys.EVENTS_MAXLEN)


async def cancel_requested(redis: aioredis.Redis, job_ids: list[str]) -> set[str]:
    """Which of these running jobs have been asked to stop."""
    if not job_ids:
        return set()
    pipe = redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.job_hash(job_id), "cancel_requested")
    flags = await pipe.execute()
    return {job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag == "1"}
