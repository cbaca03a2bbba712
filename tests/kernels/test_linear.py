"""ops.linear: the transposed few-row form gives F.linear's result, contiguous, at any size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.linear import SKINNY_ROWS


@pytest.mark.parametrize("rows", [1, 7, SKINNY_ROWS, SKINNY_ROWS + 1, 300])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (576, 1536), (49, 16)])
def test_linear_matches_f_linear(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    out = ops.linear(x, w)
    assert out.shape == (rows, n) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)
