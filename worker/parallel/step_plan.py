"""What rank 0 tells the other ranks each step, and the step they rebuild from it.

Rank 0's engine schedules; the others only compute. Each step rank 0 broadcasts the operations
its model runner performed since the last broadcast, in order: requests freed, a step sampled
(with its grammar masks), the next step's forward pass. A forward pass travels as each chunk's
position, length and known input tokens plus the block tables; a request's sampling parameters
and seed travel once, with its first chunk, and are forgotten when it is freed. The other ranks
sample too, with the same seeds on the same gathered logits, so every rank draws the same
tokens and a decode whose input is still on the device (async scheduling) finds it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidegate.protocol import SamplingParams
from tidegate.worker.engine.grammar_masks import TokenMask
from tidegate.worker.engine.sampler import is_penalised
from tidegate.worker.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a rank needs of a request besides its tokens (sent once)."""

    params: SamplingParams
    seed: int
    adapter: str | None


@dataclass(frozen=True, slots=True)
class WireChunk:
    request_id: str
    start: int
    num_tokens: int
    samples: bool
    ids: list[int]  # the chunk's input tokens the host knows, from ``start``
    # A penalised sampling row's prompt and generated tokens (the penalties read them).
    history: tuple[list[int], list[int]] | None = None


@dataclass(frozen=True, slots=True)
class ForwardOp:
    chunks: list[WireChunk]
    block_tables: list[list[int]]
    previous: bool  # decodes may take their input from the last sampled step
    new: dict[str, RequestInfo] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SampleOp:
    mask: TokenMask | None


@dataclass(frozen=True, slots=True)
class FreeOp:
    request_id: str


@dataclass(frozen=True, slots=True)
class StopOp:
    """The worker is shutting down: the other ranks leave their loop."""


Op = ForwardOp | SampleOp | FreeOp | StopOp


@dataclass(slots=True)
class PlanSeq:
    """A request as a follower rank's model runner and sampler read it."""

    request_id: str
    params: SamplingParams
    seed: int
    adapter: str | None
    offset: int  # the position of ids[0]
    ids: list[int]
    prompt_ids: list[int]
    output_ids: list[int]
    # Speculative drafts: none on a parallel worker (speculation is refused there), kept so
    # the runner reads one shape of request.
    draft: tuple[int, ...] = ()

    @property
    def num_known(self) -> int:
        return self.offset + len(self.ids)

    def token_at(self, position: int) -> int:
        return self.ids[position - self.offset]

    def ids_between(self, start: int, end: int) -> list[int]:
        return self.ids[start - self.offset : end - self.offset]


@dataclass(slots=True)
class PlanChunk:
    seq: PlanSeq
    start: int
    num_tokens: int
    samples: bool

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.samples


@dataclass(slots=True)
class PlanStep:
    """A scheduler output rebuilt from a ``ForwardOp``."""

    chunks: list[PlanChunk]


class PlanWriter:
    """Rank 0's side: the ``ForwardOp`` of a scheduler output (tracks which requests the
    other ranks know)."""

    def __init__(self) -> None:
        self._known: set[str] = set()

    def forward(self, sched: SchedulerOutput, block_tables: list[list[int]],
                previous: bool) -> ForwardOp:
        chunks: list[WireChunk] = []
        new: dict[str, RequestInfo] = {}
        for c in sched.chunks:
            seq = c.seq
            rid = seq.request_id
            if rid not in self._known:
                self._known.add(rid)
                new[rid] = RequestInfo(seq.params, seq.seed, seq.adapter)
            end = min(c.start + c.num_tokens, seq.num_known)
            ids = seq.ids_between(c.start, end) if end > c.start else []
            history = ((list(seq.prompt_ids), list(seq.output_ids))
                       if c.samples and is_penalised(seq.params) else None)
            chunks.append(WireChunk(rid, c.start, c.num_tokens, c.samples, ids, history))
        return ForwardOp(chunks, block_tables, previous, new)

    def forget(self, request_id: str) -> None:
        self._known.discard(request_id)


class PlanReader:
    """A follower rank's side: the step of a ``ForwardOp``."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestInfo] = {}

    def step(self, op: ForwardOp) -> PlanStep:
        self.requests.update(op.new)
        chunks = []
        for w in op.chunks:
            info = self.requests[w.request_id]
            prompt, output = w.history if w.history is not None else ([], [])
            seq = PlanSeq(w.request_id, info.params, info.seed, info.adapter, w.start, w.ids,
                          prompt, output)
            chunks.append(PlanChunk(seq, w.start, w.num_tokens, w.samples))
        return PlanStep(chunks)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
