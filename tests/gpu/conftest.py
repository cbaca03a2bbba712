"""Shared by the H200 tests: a fixed seed per test and the relative error they bound."""

from __future__ import annotations

import pytest
import torch

BF16_REL_ERR = 1e-2  # bf16 operands land between 1e-3 and 1e-2 against a float32 reference


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
