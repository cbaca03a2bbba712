"""The speculative-decoding interface the engine owns: what proposes drafts (``Proposer``),
what keeps them (``Verifier``), what decides when a step speculates (``Governor``), and how a
speculative engine is handed the three (``SpeculationFactory``).

The implementations are ``tidegate.worker.speculative``'s, which builds speculative engines
(``tidegate.worker.speculative.speculative_engine``); the engine never imports them. The parts
are made once the engine has built what they use: its model runner (the verifier draws with
its sampler's streams) and, for a draft model, the draft's runner over its share of the KV
budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tidegate.worker.engine.kv_cache import KVCacheSpec
from tidegate.worker.engine.model_runner import ModelRunner
from tidegate.worker.engine.sampler import SamplingRow
from tidegate.worker.engine.sequence import Sequence


class Proposer(Protocol):
    """Drafts tokens for running requests."""

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (request, limit): at most ``limit`` tokens after its tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: what the proposer keeps for it goes."""
        ...


@runtime_checkable
class CountsPasses(Protocol):
    """A proposer that runs a draft model, counting its forward passes (the engine's
    ``EngineStats.draft_passes``)."""

    passes: int


class Verifier(Protocol):
    def verify(self, logits: torch.Tensor, row: SamplingRow, draft: list[int]) -> list[int]:
        """logits [k + 1, V] at a verify chunk's positions, ``draft`` its k drafts -> the
        kept drafts and one token more (1 to k + 1 tokens)."""
        ...


class Governor(Protocol):
    def speculate(self, batch: int) -> bool:
        """Whether the next step, of ``batch`` running requests, speculates."""
        ...

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A decode step of ``batch`` requests gave ``tokens`` in ``seconds``."""
        ...


@dataclass(frozen=True, slots=True)
class Speculation:
    """The parts a speculative engine steps with."""

    proposer: Proposer
    verifier: Verifier
    governor: Governor


class SpeculationFactory(Protocol):
    def __call__(self, target: ModelRunner, draft: ModelRunner | None,
                 kv_spec: KVCacheSpec) -> Speculation:
        """The parts, from the engine's runner, the draft model's runner (a draft model was
        given) and the KV cache's plan (the draft's cache holds as many blocks)."""
        ...
