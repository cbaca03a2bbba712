"""What a worker tells the API about its prefix cache and capacity, and how it travels.

Each worker of a model writes, a few times a second while its cache changes and at least every
``ANNOUNCE_REFRESH_S`` otherwise, a small record in the model's routing table
(``keys.routing_table``: its load, seats, block size and when the record expires) and, when
its cache changed, the short hashes of its most recently cached blocks
(``keys.prefix_cache``: 8 bytes each, packed, base64, expiring with the record). The API reads
the table every ``ROUTE_REFRESH_S`` and fetches the hashes of the workers whose ``version``
moved. A record past ``expires_ms`` is ignored (its worker stopped announcing: dead, or
routing off); the model's workers delete records expired for long.
"""

from __future__ import annotations

import base64
import json
from array import array
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from tidegate import keys

if array("Q").itemsize != 8:  # pragma: no cover - every platform tidegate runs on
    raise ImportError("tidegate needs 8-byte unsigned long longs (array 'Q')")

# A record (and its hashes) expires this long after it was written.
ANNOUNCE_TTL_S = 10.0
# Workers announce at most this often while their cache changes...
ANNOUNCE_EVERY_S = 0.25
# ...and at least this often regardless (its load, the record's expiry).
ANNOUNCE_REFRESH_S = 1.0
# The API reads the routing table this often.
ROUTE_REFRESH_S = 0.25
# The most block hashes one announcement carries (newest first): 64 KiB packed, covering
# 8192 blocks (128k tokens at 16 per block) of recently cached prefixes.
MAX_ANNOUNCED_BLOCKS = 8192
# Records expired this long are deleted (and their routed streams dropped once empty).
FORGET_AFTER_S = 300.0


@dataclass(frozen=True, slots=True)
class CacheAnnouncement:
    """A worker's routing record (its hashes travel beside it)."""

    worker_id: str
    block_size: int
    seats: int  # the most requests it runs at once (max_num_seqs)
    busy: int  # requests running or waiting in it (admitted or claimed) when it announced
    queued: int  # jobs waiting unread on its own routed streams when it announced
    at_ms: int  # when it announced (the worker's wall clock)
    expires_ms: int
    version: int  # changes whenever the announced hashes change
    done_per_s: float = 0.0  # jobs it finished per second lately (the API's load estimate)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> CacheAnnouncement | None:
        """None for a record that is not one (written by another version, or damaged)."""
        try:
            data = json.loads(raw)
            record = cls(worker_id=str(data["worker_id"]), block_size=int(data["block_size"]),
                         seats=int(data["seats"]), busy=int(data["busy"]),
                         queued=int(data["queued"]), at_ms=int(data["at_ms"]),
                         expires_ms=int(data["expires_ms"]), version=int(data["version"]),
                         done_per_s=float(data.get("done_per_s", 0.0)))
        except (ValueError, TypeError, KeyError, OverflowError):
            return None
        ok = record.block_size >= 1 and record.seats >= 1 and 0 <= record.done_per_s < 1e9
        return record if ok else None


def pack_hashes(short_hashes: bytes) -> str:
    return base64.b64encode(short_hashes).decode()


def unpack_hashes(raw: str | None) -> frozenset[int]:
    """The short hashes a ``pack_hashes`` string holds (empty for a missing or bad one)."""
    if not raw:
        return frozenset()
    try:
        packed = base64.b64decode(raw, validate=True)
    except ValueError:
        return frozenset()
    values = array("Q")
    values.frombytes(packed[:len(packed) // 8 * 8])
    return frozenset(values.tolist())


async def announce(redis: aioredis.Redis, model: str, record: CacheAnnouncement,
                   short_hashes: bytes | None) -> bool:
    """Write the record, and the hashes when they changed (else only extend their life).
    False when unchanged hashes were gone (expired, or Redis restarted): write them again."""
    ttl_ms = int(ANNOUNCE_TTL_S * 1000)
    pipe = redis.pipeline(transaction=False)
    if short_hashes is not None:
        pipe.set(keys.prefix_cache(record.worker_id), pack_hashes(short_hashes), px=ttl_ms)
    else:
        pipe.pexpire(keys.prefix_cache(record.worker_id), ttl_ms)
    pipe.hset(keys.routing_table(model), record.worker_id, record.to_json())
    kept, _ = await pipe.execute()
    return bool(kept)


async def withdraw(redis: aioredis.Redis, model: str, worker_id: str) -> None:
    """A worker leaving: no job is routed to it any more."""
    pipe = redis.pipeline(transaction=False)
    pipe.hdel(keys.routing_table(model), worker_id)
    pipe.delete(keys.prefix_cache(worker_id))
    await pipe.execute()


async def read_table(redis: aioredis.Redis, model: str) -> dict[str, CacheAnnouncement]:
    """Every worker's record in the model's routing table, expired ones included."""
    raw = await redis.hgetall(keys.routing_table(model))
    table = {}
    for worker_id, value in raw.items():
        record = CacheAnnouncement.from_json(value)
        if record is not None and record.worker_id == worker_id:
            table[worker_id] = record
    return table


async def read_hashes(redis: aioredis.Redis, worker_ids: list[str]) -> dict[str, frozenset[int]]:
    """The announced short hashes of each of ``worker_ids`` (one round trip)."""
    if not worker_ids:
        return {}
    pipe = redis.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.get(keys.prefix_cache(worker_id))
    return {w: unpack_hashes(raw) for w, raw in zip(worker_ids, await pipe.execute(),
                                                      strict=True)}
