"""Idempotent submits: per tenant, an Idempotency-Key names the one job its first submit made.

The first submit claims the key with SET NX (so of two concurrent twins exactly one enqueues)
and records the job id and stream token; a repeat within ``keys.IDEMPOTENCY_TTL_S`` finds the
claim and answers with that job. A claim whose job never appeared (the API process died between
claim and enqueue) or has expired is stale and released.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.protocol import now_ms

# A claim's job is written milliseconds after the claim; after this long it never will be.
STALE_CLAIM_MS = 10_000
# How long a repeat waits for a concurrent twin's job to appear before answering 409.
WAIT_FOR_JOB_S = 2.0

# KEYS: the claim. ARGV: the claim's exact value. Deletes it only if it is still that claim.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ClaimInProgress(Exception):
    """A twin submit claimed the key but its job has not appeared yet; retry shortly."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What a repeat needs to answer exactly as the first submit did."""

    job_id: str
    stream_token: str
    created_ms: int

    def encode(self) -> str:
        # What json.dumps(asdict(self), sort_keys=True) gives, without asdict's deep copy.
        return json.dumps({"created_ms": self.created_ms, "job_id": self.job_id,
                           "stream_token": self.stream_token})


@dataclass(frozen=True, slots=True)
class Replay:
    claim: Claim
    status: str  # the job's current status


async def claim(redis: aioredis.Redis, tenant: str, key: str, new: Claim, *,
                ttl_s: int = keys.IDEMPOTENCY_TTL_S) -> bool:
    """Claim ``key`` for ``ttl_s`` for the job about to be enqueued; False if an earlier
    submit holds it. Longer than the job's retention buys nothing: a claim whose job expired
    is released by the next ``replay``."""
    return bool(await redis.set(keys.idempotency(tenant, key), new.encode(), nx=True,
                                ex=ttl_s))


async def release(redis: aioredis.Redis, tenant: str, key: str, held: Claim) -> None:
    """Give up a claim whose job could not be enqueued, so a retry can make it."""
    await redis.eval(_RELEASE_LUA, 1, keys.idempotency(tenant, key), held.encode())


async def replay(redis: aioredis.Redis, tenant: str, key: str) -> Replay | None:
    """The job an earlier submit with ``key`` made, and its status; None if there is none.

    Waits up to ``WAIT_FOR_JOB_S`` for a concurrent twin to enqueue its job, then raises
    ``ClaimInProgress``.
    """
    deadline = time.monotonic() + WAIT_FOR_JOB_S
    while (held := await _read(redis, tenant, key)) is not None:
        status = await redis.hget(keys.job_hash(held.job_id), "status")
        if status is not None:
            return Replay(held, status)
        if now_ms() - held.created_ms > STALE_CLAIM_MS:
            await release(redis, tenant, key, held)
            return None
        if time.monotonic() > deadline:
            raise ClaimInProgress(f"a submit with this idempotency key is in progress ({key!r})")
        await asyncio.sleep(0.01)
    return None


async def _read(redis: aioredis.Redis, tenant: str, key: str) -> Claim | None:
    raw = await redis.get(keys.idempotency(tenant, key))
    return None if raw is None else Claim(**json.loads(raw))
