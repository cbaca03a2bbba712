"""The scheduler: which tokens of which requests run in the next step.

Each step fills a token budget (``max_num_batched_tokens``, or less where ``step_budget``
says so) under a sequence cap (``max_num_seqs``). Running decodes are placed first, so a long
prompt never stalls them; the rest of the budget goes to prompt chunks (chunked prefill: a long
prompt is split across steps), first of running requests, then of waiting ones in order of lane
(interactive first), priority, earliest deadline, arrival. ``step_budget`` (given the step's
decode count, the tokens the step may carry) keeps a step that decodes short enough for its
requests' time per token while prompts still advance (``StepBudget``). When the cache runs out
of blocks, the running request that comes last in that order is preempted: its blocks are freed
and it is recomputed later, never failed.
Requests with LoRA adapters run only while their adapters fit the device's slots: at most
``max_adapters`` distinct adapters among the running requests. A waiting request whose adapter
does not fit lets requests of the base model pass, but not those of other adapters, so the
running adapters drain and it gets its slot. Plain Python: no torch.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tidegate.routing.prefix_hashes import block_hash, prompt_block_hashes
from tidegate.worker.engine.block_manager import BlockManager
from tidegate.worker.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_adapters: int = 0  # distinct LoRA adapters among running requests (the device's slots)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_adapters < 0:
            raise ValueError("max_adapters must not be negative")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs, "
                             "so every running request can decode in every step")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the chunk's first token (the sequence's num_computed)
    num_tokens: int  # tokens computed this step
    samples: bool  # the chunk reaches the sequence's last token, so a new token is sampled

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.samples


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner computes this step, decodes first, then prompt chunks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Kept in step with ``chunks`` by add / drop: summing per chunk made scheduling a step of
    # n sequences cost n^2 (a third of a 1000-sequence decode step).
    num_batched_tokens: int = 0

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_batched_tokens += chunk.num_tokens

    def drop(self, seq: Sequence) -> None:
        """Take ``seq``'s chunk (if scheduled) back out of the step."""
        for chunk in [c for c in self.chunks if c.seq is seq]:
            self.chunks.remove(chunk)
            self.num_batched_tokens -= chunk.num_tokens

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)


# A waiting request waits a step for a running request's prefill rather than compute the
# same blocks beside it when they are at least this many tokens (a long system prompt).
HOLD_MIN_TOKENS = 256


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache on admission, and those found there.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.adapters: Counter[str] = Counter()  # running requests per adapter
        # Full blocks running requests are prefilling, not registered in the prefix cache
        # yet: block hash -> (the request, the token count that completes the block). A
        # request whose next uncached block is one of them waits for it instead of computing
        # it too (requests sharing a new prefix arrive together: a burst, or routed jobs).
        self._in_flight: dict[bytes, tuple[Sequence, int]] = {}
        self.num_held = 0  # waiting requests the last schedule held for such a block
        # Whether the last schedule left a waiting request out for want of room (KV blocks or
        # a seat), not merely of this step's token budget: the worker then reads no more jobs.
        self.out_of_room = False
        # Given the step's decodes, the tokens it may carry (None: max_num_batched_tokens).
        self.step_budget: Callable[[int], int] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a request out (finished or aborted), releasing its blocks."""
        if seq in self.running:
            self._leave(seq)
            self.blocks.free(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self, hold_pending: bool = False, max_seqs: int | None = None
                 ) -> SchedulerOutput:
        """The next step. ``hold_pending`` (pipeline parallelism, several steps in flight):
        requests with a token still being sampled sit this step out, so a step never needs
        the tokens of another step in flight; ``max_seqs``: at most this many requests in
        the step (so the running requests split into groups that take turns)."""
        cap = self.config.max_num_seqs if max_seqs is None else max_seqs
        out = SchedulerOutput()
        self.running.sort(key=Sequence.sort_key)
        # A request holding its last token (still being sampled) needs no more compute: it
        # ends when that token is read, and no cache slot is taken beyond its limit.
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            left = seq.num_uncomputed
            if hold_pending and seq.num_pending:
                continue
            if left > 1:
                prefills.append(seq)
            elif left == 1 and not seq.is_complete:
                decodes.append(seq)
        limit = self.config.max_num_batched_tokens
        if self.step_budget is not None:
            limit = max(1, min(limit, self.step_budget(len(decodes))))
        for seq in decodes + prefills:
            # A preempted victim's chunk leaves the batch, so the budget is recounted each time.
            budget = limit - out.num_batched_tokens
            if seq.status is not SeqStatus.RUNNING or budget == 0 or len(out.chunks) >= cap:
                continue  # preempted earlier in this loop, or no budget or room left
            n = min(seq.num_uncomputed, budget)
            if seq.draft and n < seq.num_uncomputed:
                # A verify chunk samples at its end: fewer drafts, not a chunk cut short.
                del seq.draft[n - 1 :]
            end = seq.num_computed + n
            # Most decodes land in a block the request holds already: nothing to make room for
            # or to grow (this loop runs for every running request, every step).
            if not self.blocks.holds(seq.request_id, end):
                if not self._make_room(seq, end, out):
                    continue
                self.blocks.append_slot(seq.request_id, end)
            out.add(ScheduledChunk.of(seq, n))
        self.out_of_room = bool(out.preempted)
        if not out.preempted:  # under memory pressure, let running requests finish first
            self._admit_waiting(limit - out.num_batched_tokens, out, hold_pending, cap)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """Record that the runner computed the scheduled chunks (before new tokens append).

        A request that finished after its step was scheduled (possible when the engine builds
        outputs while the next step runs) has freed its blocks: its chunk is skipped. A token
        still pending (sampled, not read back) lies at ``num_computed``, never inside a full
        computed block, so no block is registered under a hash of an unknown token."""
        bs = self.blocks.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed = chunk.start + chunk.num_tokens
            assert seq.num_computed <= seq.num_known, "a pending token was computed"
            if seq.num_computed // bs > chunk.start // bs:  # a block became full: register it
                self.blocks.commit(seq.request_id, seq.all_ids(), seq.num_computed)

    def _admit_waiting(self, budget: int, out: SchedulerOutput,
                       hold_pending: bool = False, cap: int | None = None) -> None:
        i = 0
        self.num_held = 0
        adapters_closed = False  # an earlier request's adapter found no slot
        cap = self.config.max_num_seqs if cap is None else cap
        while (i < len(self.waiting) and budget > 0 and len(out.chunks) < cap
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[i]
            # Blocked: a sibling computes the shared prompt first. Pending: preempted with a
            # token still in flight. Either way, let others pass.
            if seq.blocked or (hold_pending and seq.num_pending):
                i += 1
                continue
            if seq.adapter is not None and (adapters_closed or not self._adapter_fits(seq)):
                adapters_closed = True
                i += 1
                continue
            ids = seq.all_ids()  # a preempted request recomputes its generated tokens too
            salt = seq.cache_salt
            hits = self.blocks.cached_prefix(ids, salt)
            cached = len(hits) * self.blocks.block_size
            if self._in_flight and self._computed_elsewhere(seq, ids, hits, salt):
                i += 1  # another request computes its next block now: reuse it next step
                self.num_held += 1
                continue
            n = min(len(ids) - cached, budget)
            if not self.blocks.can_allocate(ids, cached + n, salt):
                self.out_of_room = True
                break
            self.waiting.pop(i)
            self.prefix_query_tokens += len(ids)
            self.prefix_hit_tokens += cached
            seq.num_computed = self.blocks.allocate(seq.request_id, ids, cached + n, salt)
            seq.num_cached_prompt = seq.num_computed
            if self.blocks.prefix_caching:
                self._note_in_flight(seq, ids, hits, salt)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.adapter is not None:
                self.adapters[seq.adapter] += 1
            out.add(ScheduledChunk.of(seq, n))
            budget -= n
        if i < len(self.waiting) and len(self.running) >= self.config.max_num_seqs:
            self.out_of_room = True  # a request waits for a seat

    def _computed_elsewhere(self, seq: Sequence, ids: list[int], hits: list[int],
                            salt: bytes | None) -> bool:
        """Whether at least ``HOLD_MIN_TOKENS`` of ``ids`` past the cached ``hits`` are being
        prefilled by another running request (cached once that request's chunks are done):
        worth a step's wait. A shorter shared part (a chat template's default system prompt,
        shared by every chat) is computed again rather than delay the request."""
        bs = self.blocks.block_size
        start = len(hits) * bs
        usable = (len(ids) - 1) // bs  # the full blocks the cache could serve
        if usable * bs - start < HOLD_MIN_TOKENS:
            return False
        parent = self.blocks.hash_of(hits[-1]) if hits else salt
        found = 0
        for j in range(len(hits), usable):
            parent = block_hash(parent, ids[j * bs:(j + 1) * bs])
            holder = self._in_flight.get(parent)
            if holder is None:
                break
            other, end = holder
            if other is seq or other.status is not SeqStatus.RUNNING or other.num_computed >= end:
                del self._in_flight[parent]  # done, preempted or ended
                break
            found += 1
            if found * bs >= HOLD_MIN_TOKENS:
                return True
        return False

    def _note_in_flight(self, seq: Sequence, ids: list[int], hits: list[int],
                        salt: bytes | None) -> None:
        """Record the full blocks ``seq`` prefills from here (its uncached part)."""
        bs = self.blocks.block_size
        first = len(hits)
        if (len(ids) // bs - first) * bs < HOLD_MIN_TOKENS:
            return  # too short for anyone to wait for
        parent = self.blocks.hash_of(hits[-1]) if hits else salt
        if len(self._in_flight) > max(1024, self.blocks.num_blocks):  # drop what ended
            self._in_flight = {h: (o, e) for h, (o, e) in self._in_flight.items()
                               if o.status is SeqStatus.RUNNING and o.num_computed < e}
        for j, h in enumerate(prompt_block_hashes(ids[first * bs:], bs, parent, whole=True),
                              start=first):
            self._in_flight.setdefault(h, (seq, (j + 1) * bs))

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter can run beside the running requests' adapters."""
        return seq.adapter in self.adapters or len(self.adapters) < self.config.max_adapters

    def _leave(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running requests (it finished, or is preempted)."""
        self.running.remove(seq)
        if seq.adapter is not None:
            self.adapters[seq.adapter] -= 1
            if not self.adapters[seq.adapter]:
                del self.adapters[seq.adapter]

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of the order until ``seq`` fits; False if it went itself."""
        while not self.blocks.can_append(seq.request_id, num_tokens):
            victim = max(self.running, key=Sequence.sort_key)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        out.drop(victim)
        victim.draft.clear()
        self._leave(victim)
        self.blocks.free(victim.request_id)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.add(victim)
        out.preempted.append(victim)
