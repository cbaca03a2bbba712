"""How many tokens an engine step may carry, so the requests decoding in it keep their pace.

A running request gets one token per step, so every step that decodes delays each of its
requests' next token by the whole step. Prompt chunks ride in the same steps (chunked prefill):
a step that also computes 16,384 prompt tokens of an 8B model takes a third of a second, and
every running request waits that long for its next token. Sarathi-Serve's stall-free batching
bounds the tokens of each step by the time between tokens a deployment targets, from a profile
of the device; here the bound is recomputed every step from what the worker measures as it runs
(the load shedder's windows over recent steps): the decode step's time at this batch size, and
the prompt tokens per second of the steps that carry prompt work. A step with decodes carries
as many prompt tokens as fit in what ``max_step_s`` leaves after its decodes, and never fewer
than ``min_prefill_tokens`` (so prompts advance even when decoding alone fills the target); a
step with no decodes has nobody to delay and takes the engine's whole budget. Plain Python: no
torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StepCosts(Protocol):
    """What steps cost on this device (``LoadShedder`` measures both)."""

    def step_s(self, batch_size: int) -> float: ...

    def prefill_tok_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class StepBudgetConfig:
    max_step_s: float  # a step that decodes should take about this long at most
    max_tokens: int  # the engine's max_num_batched_tokens: never more
    min_prefill_tokens: int = 512  # prompt tokens a step may always carry beside its decodes

    def __post_init__(self) -> None:
        if self.max_step_s <= 0:
            raise ValueError("max_step_s must be positive")
        if self.max_tokens < 1 or self.min_prefill_tokens < 1:
            raise ValueError("max_tokens and min_prefill_tokens must be positive")


class StepBudget:
    """The scheduler's ``step_budget``: given a step's decodes, the tokens it may carry."""

    def __init__(self, config: StepBudgetConfig, costs: StepCosts) -> None:
        self.config = config
        self.costs = costs

    def __call__(self, decodes: int) -> int:
        cfg = self.config
        if decodes == 0:
            return cfg.max_tokens
        spare_s = cfg.max_step_s - self.costs.step_s(decodes)
        prefill = max(cfg.min_prefill_tokens, int(spare_s * self.costs.prefill_tok_s()))
        return min(cfg.max_tokens, decodes + prefill)
