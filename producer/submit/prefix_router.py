"""Prefix-aware routing: which worker's stream a job goes to, decided where it is submitted.

Workers announce the short hashes of the blocks their prefix caches hold and their load
(``tidegate.routing.cache_announcement``); the API computes the prompt's block hashes
(``tidegate.routing.prefix_hashes``: the worker's own) and sends the job to the live worker
holding the longest chain of them, on that worker's routed stream, which it reads before the
shared lanes. Any worker takes what waited there past the steal delay, so a busy or dead
worker delays a job by that much at most.

* **Matches** count the announced hashes and this router's own recent routes (``predict_s``):
  the jobs of a burst follow the first job of their prefix before any worker has announced it.
* **Cost**: each worker's would-be computed prompt tokens (those past its match) plus the
  whole prompt's per ``BALANCE`` x seats jobs of its load (announced busy and queued, plus
  what this router sent it since). A worker holding the prefix keeps its jobs until it runs
  half its seats more than another: computing a long prefix again costs a prefill that
  stalls the other worker's batch for its duration.
* **Load**: a worker whose seats are all taken is passed over for one with a free seat, which
  then computes the prefix too: a prefix in demand spreads to as many workers as its load
  needs. With every seat taken, the cheapest worker anyway (stealing evens out the rest).
* **A new prefix** (no worker holds half the prompt): the worker this router sent the fewest
  new prefixes lately, then the fewest jobs (counts halving every ``RECENT_HALF_LIFE_S``)
  plus its load, so prefixes and their traffic spread evenly; ties broken by rendezvous
  hashing of the prompt's first block no worker holds, so several API processes place a new
  prefix alike. Shallow matches (a chat
  template's first blocks, shared by every prompt) don't pull new prefixes to one worker.
* **Shared lane**: a prompt without a full block, or no live worker announcing (routing off
  on the workers, or none up): the job goes where it went before routing existed.

Plain Python and a clock: no torch; ``refresh`` is its only Redis I/O.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from tidegate.routing.cache_announcement import (
    CacheAnnouncement,
    read_hashes,
    read_table,
)
from tidegate.routing.prefix_hashes import prompt_block_hashes, short

# A route this router made counts as a match for this long (then the announcements tell).
PREDICT_S = 10.0
# How far a worker holding a prompt's prefix may run ahead of another (jobs running or queued,
# as a fraction of its seats) before the other computes the prefix too and takes the job: the
# cost of a worker is the prompt tokens it would compute plus the whole prompt's per
# BALANCE x seats jobs of load. A prefix in demand spreads over as many workers as its load
# needs; a match of a chat template's first block or two (a few percent of the prompt) is
# outweighed by less than a job: it never piles jobs onto one worker.
BALANCE = 0.5
# A new prefix goes where the fewest jobs went lately: counted with this half-life.
RECENT_HALF_LIFE_S = 10.0
# Routes a router remembers per worker (the newest win).
MAX_PREDICTED = 65536


@dataclass(frozen=True, slots=True)
class Route:
    """Where a job goes: ``worker_id`` None is the shared lane."""

    worker_id: str | None
    kind: str  # "cached": a worker holds part of it; "placed": first sight; "shared"
    matched_blocks: int = 0


SHARED = Route(None, "shared")


@dataclass(slots=True)
class _Worker:
    record: CacheAnnouncement
    hashes: frozenset[int] = frozenset()
    hashes_version: int | None = None  # the record version ``hashes`` were fetched for
    sent: int = 0  # jobs this router routed to it since its record was made
    predicted: dict[int, float] = field(default_factory=dict)  # short hash -> expiry (clock)
    # Jobs, and new prefixes, this router sent it: counts halving every RECENT_HALF_LIFE_S.
    recent: float = 0.0
    recent_new: float = 0.0
    recent_at: float = 0.0

    def load(self, now_ms: int) -> float:
        """Its jobs as announced, plus those sent since, less those it likely finished since
        (at its announced rate): the record may be a second old."""
        left = self.record.done_per_s * max(0, now_ms - self.record.at_ms) / 1000
        return self.record.busy + self.record.queued + max(0.0, self.sent - left)

    def lately(self, now: float) -> tuple[float, float]:
        """(new prefixes, jobs) this router sent it lately."""
        decay = 0.5 ** ((now - self.recent_at) / RECENT_HALF_LIFE_S)
        return self.recent_new * decay, self.recent * decay

    def took(self, now: float, *, new_prefix: bool) -> None:
        new, jobs = self.lately(now)
        self.recent_new, self.recent, self.recent_at = new + new_prefix, jobs + 1, now

    def holds(self, h: int, now: float) -> bool:
        if h in self.hashes:
            return True
        expiry = self.predicted.get(h)
        return expiry is not None and expiry > now


class PrefixRouter:
    """One model's routing: the workers' announcements, and this process's recent routes."""

    def __init__(self, *, predict_s: float = PREDICT_S, balance: float = BALANCE,
                 clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.predict_s = predict_s
        self.balance = balance
        self.clock = clock  # for predictions
        self.wall_ms = wall_ms  # against the records' expiry (the workers' wall clocks)
        self._workers: dict[str, _Worker] = {}

    # ------------------------------------------------------------------ what workers said

    def observe(self, table: dict[str, CacheAnnouncement],
                hashes: dict[str, frozenset[int]]) -> None:
        """Take the routing table as read; ``hashes``: those fetched for changed versions."""
        workers: dict[str, _Worker] = {}
        for worker_id, record in table.items():
            known = self._workers.get(worker_id)
            if known is None:
                known = _Worker(record)
            elif record.at_ms != known.record.at_ms:
                known.sent = 0  # its new record counts what it took since
            if worker_id in hashes:
                known.hashes, known.hashes_version = hashes[worker_id], record.version
            known.record = record
            workers[worker_id] = known
        self._workers = workers

    def stale(self, table: dict[str, CacheAnnouncement]) -> list[str]:
        """The live workers of ``table`` whose hashes this router lacks or holds older."""
        now = self.wall_ms()
        return [w for w, record in table.items() if record.expires_ms > now and (
            (known := self._workers.get(w)) is None or known.hashes_version != record.version)]

    async def refresh(self, redis: aioredis.Redis, model: str) -> None:
        """Read the model's routing table, and the hashes of workers whose cache changed."""
        table = await read_table(redis, model)
        self.observe(table, await read_hashes(redis, self.stale(table)))

    # ------------------------------------------------------------------ routing

    def live(self) -> list[str]:
        return [k.record.worker_id for k in self._live(self.wall_ms())]

    def _live(self, now_ms: int) -> list[_Worker]:
        return [k for k in self._workers.values() if k.record.expires_ms > now_ms]

    def route(self, prompt_ids: Sequence[int], salt: bytes | None = None) -> Route:
        """Where a job with these prompt tokens (and adapter salt) goes; remembered as a
        prediction and as load on the chosen worker."""
        now_ms = self.wall_ms()
        live = self._live(now_ms)
        if not live:
            return SHARED
        by_size: dict[int, list[int]] = {}
        for k in live:
            if k.record.block_size not in by_size:
                by_size[k.record.block_size] = [
                    short(h) for h in prompt_block_hashes(prompt_ids, k.record.block_size, salt)]
        if not any(by_size.values()):
            return SHARED  # shorter than a block: nothing to share
        now = self.clock()
        free = [k for k in live if k.load(now_ms) < k.record.seats]
        pool = free or live
        matched = {k.record.worker_id: self._matched(k, by_size[k.record.block_size], now)
                   for k in pool}
        deepest = max(matched[k.record.worker_id] * k.record.block_size for k in pool)
        # Rendezvous key: the prompt's first block no worker holds (for a new system prompt,
        # the first block past the template's header: the same for all its jobs).
        hashes = by_size[pool[0].record.block_size]
        novel = hashes[min(deepest // pool[0].record.block_size, len(hashes) - 1)]

        def cost(k: _Worker) -> tuple[float, float, int]:
            # The prompt tokens it would compute, plus its load in prompts: a deep match wins
            # over a somewhat idler worker.
            uncached = len(prompt_ids) - matched[k.record.worker_id] * k.record.block_size
            fill = k.load(now_ms) / k.record.seats
            return (uncached + len(prompt_ids) * fill / self.balance, fill,
                    -_rendezvous(novel, k.record.worker_id))

        def share(k: _Worker) -> tuple[float, float, int]:
            # A new prefix: where the fewest new prefixes, then the fewest jobs, went lately,
            # so prefixes (and their future jobs) spread evenly; a chat template's shared
            # first blocks don't count.
            new, jobs = k.lately(now)
            return new, jobs + k.load(now_ms), -_rendezvous(novel, k.record.worker_id)

        new_prefix = 2 * deepest < len(prompt_ids)
        chosen = min(pool, key=share) if new_prefix else min(pool, key=cost)
        chosen.sent += 1
        chosen.took(now, new_prefix=new_prefix)
        expiry = now + self.predict_s
        for h in by_size[chosen.record.block_size]:
            chosen.predicted[h] = expiry
        if len(chosen.predicted) > MAX_PREDICTED:
            self._forget_predictions(chosen, now)
        got = matched[chosen.record.worker_id]
        return Route(chosen.record.worker_id, "placed" if new_prefix else "cached", got)

    @staticmethod
    def _matched(worker: _Worker, hashes: list[int], now: float) -> int:
        n = 0
        for h in hashes:
            if not worker.holds(h, now):
                break
            n += 1
        return n

    @staticmethod
    def _forget_predictions(worker: _Worker, now: float) -> None:
        live = {h: t for h, t in worker.predicted.items() if t > now}
        if len(live) > MAX_PREDICTED:  # newest routes win (insertion order)
            live = dict(list(live.items())[-MAX_PREDICTED:])
        worker.predicted = live


def _rendezvous(first_block: int, worker_id: str) -> int:
    """Highest-random-weight: each (prefix, worker) pair's weight, the same in every process."""
    digest = hashlib.blake2b(first_block.to_bytes(8, "little") + worker_id.encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little")
