"""StepBudget: a step's tokens from the time its decodes may take and the measured costs."""

from __future__ import annotations

import pytest

from tidegate.worker.shedding.load_shedder import LoadShedder
from tidegate.worker.shedding.step_budget import StepBudget, StepBudgetConfig


class Costs:
    """A device whose decode step costs 10 ms + 0.02 ms a request, prefill 100k tokens/s."""

    def step_s(self, batch_size: int) -> float:
        return 0.010 + 0.00002 * batch_size

    def prefill_tok_s(self) -> float:
        return 100_000.0


def budget(max_step_s: float = 0.040, max_tokens: int = 16384, floor: int = 512) -> StepBudget:
    return StepBudget(StepBudgetConfig(max_step_s, max_tokens, floor), Costs())


def test_no_decodes_take_the_engines_whole_budget() -> None:
    assert budget()(0) == 16384


def test_prompt_tokens_fill_what_the_decodes_leave_of_the_target() -> None:
    # 100 decodes: a 12 ms step, 28 ms left at 100k tokens/s = 2,800 prompt tokens.
    assert budget()(100) == 100 + 2800
    # 1000 decodes: a 30 ms step, 10 ms left: 1,000 prompt tokens.
    assert budget()(1000) == 1000 + 1000


def test_prompts_always_advance_by_the_floor() -> None:
    # 2000 decodes: a 50 ms step, already past the 40 ms target.
    assert budget()(2000) == 2000 + 512
    assert budget(floor=64)(2000) == 2000 + 64


def test_never_more_than_the_engines_budget() -> None:
    assert budget(max_step_s=1.0)(10) == 16384
    assert budget(max_tokens=2048)(100) == 2048  # 100 + 2,800 capped


def test_follows_what_the_shedder_measures() -> None:
    """Wired to a ``LoadShedder``, the budget moves with the steps the worker times."""
    shedder = LoadShedder()
    for batch in (10, 20, 30, 40):  # decode steps: 5 ms + 0.5 ms a request
        shedder.observe_step(0, batch, 0.005 + 0.0005 * batch)
    shedder.observe_step(10_000, 0, 0.1)  # 100k prompt tokens/s
    paced = StepBudget(StepBudgetConfig(0.040, 16384, 256), shedder)
    # 20 decodes: 15 ms, 25 ms left: 2,500 prompt tokens.
    assert paced(20) == pytest.approx(20 + 2500, abs=1)
    shedder.observe_step(10_000, 0, 0.2)  # prefill measured twice as slow now: 66.7k tokens/s
    assert paced(20) == pytest.approx(20 + 1666, abs=1)


@pytest.mark.parametrize("kwargs", [{"max_step_s": 0.0}, {"max_step_s": 0.04, "max_tokens": 0},
                                    {"max_step_s": 0.04, "min_prefill_tokens": 0}])
def test_config_is_checked(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StepBudgetConfig(**{"max_tokens": 16, **kwargs})
