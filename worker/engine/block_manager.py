"""The paged KV cache's bookkeeping: fixed-size blocks, block tables, prefix caching.

The cache is a pool of ``num_blocks`` blocks of ``block_size`` tokens. Each request owns a block
table; blocks are reference-counted so requests sharing a prompt prefix share its blocks. A full
block whose keys and values have been computed is registered under a hash of (previous block's
hash, its token ids); a later request whose prompt starts with the same tokens reuses it instead
of computing it again. A block nobody references keeps its contents and stays findable until it
is evicted, least recently used first, to make room. Plain Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

from tidegate.routing.prefix_hashes import block_hash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and its contents are computed


@dataclass(slots=True)
class _Table:
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of the leading full, committed blocks
    salt: bytes | None = None  # what the first block's hash starts from (``cached_prefix``)


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, found computed already

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, *, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # never used, or holding nothing
        # Unreferenced blocks that still hold a computed prefix, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._tables: dict[str, _Table] = {}
        self.stats = PrefixCacheStats()
        self.changes = 0  # bumped whenever a hash is registered or evicted (announcements)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_of(self, block_id: int) -> bytes | None:
        """The hash a cached block is registered under (None: not a cached block)."""
        return self.blocks[block_id].hash

    def recent_hashes(self, limit: int) -> bytes:
        """The first 8 bytes of each of the ``limit`` most recently registered cached blocks'
        hashes, newest first, packed: what a worker announces for prefix-aware routing
        (``tidegate.routing``). Read it between steps, never while one runs."""
        return b"".join(h[:8] for h in islice(reversed(self._by_hash), limit))

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id].blocks

    def cached_prefix(self, token_ids: Sequence[int], salt: bytes | None = None) -> list[int]:
        """Ids of the computed blocks that match the start of ``token_ids``.

        Only blocks lying wholly before the last token count: that token is always computed,
        since its logits pick the next one. ``salt`` separates caches of the same tokens
        computed differently (a LoRA adapter's): the first block's hash starts from it.
        """
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        parent: bytes | None = salt
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._by_hash.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ------------------------------------------------------------------ check, then act

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int,
                     salt: bytes | None = None) -> bool:
        """Whether a new request can get blocks for its first ``num_tokens`` tokens."""
        hits = self.cached_prefix(token_ids, salt)
        needed = self.blocks_for(num_tokens) - len(hits)
        # Taking an evictable hit removes it from the pool the new blocks come from.
        reusable_hits = sum(1 for b in hits if b in self._evictable)
        return needed <= self.num_free_blocks - reusable_hits

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                 salt: bytes | None = None) -> int:
        """Give a new request its block table; returns how many tokens are already computed."""
        if seq_id in self._tables:
            raise ValueError(f"{seq_id} already has blocks")
        hits = self.cached_prefix(token_ids, salt)
        table = _Table(salt=salt)
        for block_id in hits:
            self._take(block_id)
            table.blocks.append(block_id)
            table.hashes.append(self.blocks[block_id].hash)  # type: ignore[arg-type]
        self._tables[seq_id] = table
        self._grow(table, num_tokens)
        cached = len(hits) * self.block_size
        self.stats.queried_tokens += len(token_ids)
        self.stats.hit_tokens += cached
        return cached

    def holds(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the request's table has slots for ``num_tokens`` tokens already."""
        return len(self._tables[seq_id].blocks) * self.block_size >= num_tokens

    def can_append(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens."""
        have = len(self._tables[seq_id].blocks)
        return self.blocks_for(num_tokens) - have <= self.num_free_blocks

    def append_slot(self, seq_id: str, num_tokens: int) -> None:
        """Grow the request's table to hold ``num_tokens`` tokens (after ``can_append``)."""
        self._grow(self._tables[seq_id], num_tokens)

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's newly full, computed blocks for reuse by later prompts."""
        if not self.prefix_caching:
            return
        table = self._tables[seq_id]
        for i in range(len(table.hashes), num_computed // self.block_size):
            parent = table.hashes[-1] if table.hashes else table.salt
            h = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            table.hashes.append(h)
            block = self.blocks[table.blocks[i]]
            if block.hash is None and h not in self._by_hash:
                block.hash = h
                self._by_hash[h] = block.block_id
                self.changes += 1

    def free(self, seq_id: str) -> None:
        """Release the request's blocks; computed full ones stay cached until evicted."""
        table = self._tables.pop(seq_id)
        # Tail first, so a prefix's later blocks are evicted before the blocks they extend.
        for block_id in reversed(table.blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # ------------------------------------------------------------------ internals

    def _grow(self, table: _Table, num_tokens: int) -> None:
        while len(table.blocks) < self.blocks_for(num_tokens):
            table.blocks.append(self._take(self._fresh_block()))

    def _fresh_block(self) -> int:
        if self._free:
            return self._free.popleft()
        if not self._evictable:
            raise RuntimeError("KV cache out of blocks: call can_allocate/can_append first")
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        del self._by_hash[block.hash]  # type: ignore[arg-type]
        block.hash = None
        self.changes += 1
        return block_id

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1
        return block_id
