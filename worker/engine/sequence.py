"""One request's state inside the engine: its tokens, progress, priority, sampling and stop state."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from tidegate.protocol import FinishReason, SamplingParams
from tidegate.routing.prefix_hashes import adapter_salt
from tidegate.worker.engine.detokenizer import IncrementalDetokenizer

LANE_RANK = {"interactive": 0, "batch": 1}


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    seed: int  # the request's own RNG stream: same seed, same tokens, whatever the batch
    arrival: int  # engine-wide admission counter: ties break first come, first served
    lane: str = "interactive"
    priority: int = 0  # higher runs first within a lane
    deadline_ms: int | None = None
    output_ids: list[int] = field(default_factory=list)
    # Tokens sampled on the device but not read back yet (async scheduling launches the next
    # step first): counted in ``num_tokens``, so they are scheduled and get cache slots, but
    # not in ``output_ids``. They are always the sequence's last tokens.
    num_pending: int = 0
    max_num_tokens: int | None = None  # prompt + max_tokens within the context; None: no cap
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose keys and values are in the cache
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache (last admission)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    grammar_failed: bool = False  # its grammar refused a token (a grammar engine bug)
    grammar_complete: bool = False  # its grammar can take no more tokens: it ends
    # Choices of one request (n > 1): the request's id and this choice's number; choice 0's
    # id is the request's. ``waits_for``: admitted once that sibling computed the prompt, so
    # the prefix cache hands it the prompt's blocks instead of computing them again.
    group_id: str = ""
    choice: int = 0
    waits_for: Sequence | None = None
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # Speculative decoding: tokens proposed after its known ones for the next step, which
    # computes them with its last token (counted in ``num_tokens``; cleared once verified).
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id

    @property
    def blocked(self) -> bool:
        """Waiting for a sibling to compute the shared prompt first."""
        first = self.waits_for
        return (first is not None and first.status is not SeqStatus.FINISHED
                and first.num_computed < len(first.prompt_ids))

    @property
    def num_tokens(self) -> int:
        """Every token, pending ones included: what the scheduler and the cache count."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending + len(self.draft)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has: ``all_ids()`` and ``token_at`` cover these."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_complete(self) -> bool:
        """It holds its last token (read back or pending): nothing more is computed for it,
        and its request ends once that token is read."""
        return self.max_num_tokens is not None and self.num_tokens >= self.max_num_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def cache_salt(self) -> bytes | None:
        """What its prefix-cache hashes start from: keys and values computed with an adapter
        are that adapter's (every projection's output differs), never the base model's."""
        return adapter_salt(self.adapter)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """The known tokens at positions ``start`` to ``end`` (a prompt chunk's inputs; past
        the known ones, the draft's)."""
        n = len(self.prompt_ids)
        if self.draft and end > self.num_known:
            return self.ids_between(start, self.num_known) + self.draft[
                max(0, start - self.num_known) : end - self.num_known]
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def token_at(self, position: int) -> int:
        """The token at ``position`` without building ``all_ids()`` (a decode step's input)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def sort_key(self) -> tuple[int, int, float, int]:
        """Scheduling order: lane, then priority, then earliest deadline, then arrival."""
        deadline = math.inf if self.deadline_ms is None else self.deadline_ms
        return (LANE_RANK.get(self.lane, len(LANE_RANK)), -self.priority, deadline, self.arrival)
