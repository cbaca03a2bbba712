"""One request's state inside the engine: its tokens, progress, sampling and stop state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidegate.protocol import FinishReason, SamplingParams
from worker.detokenizer import IncrementalDetokenizer


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
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose keys and values are in the cache
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
