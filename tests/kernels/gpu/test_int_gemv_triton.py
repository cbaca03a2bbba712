"""The integer-dot GEMV (``tidegate.kernels.gpu.int_gemv_triton``), the default for 1-2 rows of an integer
projection: against ``int_gemv_ref`` (activations rounded to int8 per run of 32 as the kernel
rounds them, then the float product with the dequantized weights), and against the unrounded
activations within the rounding's own error; 4 and 8 bits, groups of 32, 64, 128 and the whole
row, symmetric and asymmetric, act-order, rows that are whole tiles and rows that are not, the
RMSNorm prologue, SiLU-and-mul, the residual add, persistent programs looping over several
blocks, and which calls it serves.

Without CUDA they run in Triton's interpreter, where ``dp4a`` is spelled out in integer
arithmetic (the PTX instruction itself runs in ``tests/gpu/test_gpu_int_linear.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tidegate.kernels.cpu.linear import linear_ref
from tidegate.kernels.gpu.int_gemv_triton import (
    IntGemvConfig,
    applies,
    default_config,
    int_gemv_ref,
)
from tidegate.kernels.gpu.int_linear_triton import int_linear_triton
from tidegate.kernels.weights.int_weight import IntWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
N = 40  # no multiple of the blocks below
# 1-warp programs over blocks of 4 rows, 2 programs (several blocks each); 4 warps, 1 row.
CONFIGS = [IntGemvConfig(block_n=4, per_sm=1, num_warps=1),
           IntGemvConfig(block_n=1, per_sm=2, num_warps=4)]


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def int_weight(n: int, k: int, bits: int, group: int | None, symmetric: bool = True,
               act_order: bool = False) -> IntWeight:
    w = IntWeight.quantize(torch.randn(n, k) / k**0.5, bits, group, symmetric).to(DEVICE)
    return dataclasses.replace(w, perm=torch.randperm(k, device=DEVICE)) if act_order else w


def activations(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(m, k + 8, device=DEVICE, dtype=dtype)[:, :k]  # a padded row stride


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # The same int8 activations and integer weights on both sides: float32 sums in another
    # order (the kernel's integer sums are exact), rounded to dtype.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-3, "atol": 3e-3}
    assert out.dtype == want.dtype and out.shape == want.shape and out.is_contiguous()
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "group", "k"), [
    (4, 32, 256), (4, 128, 256), (4, None, 320), (8, None, 256), (8, 64, 320)])
def test_rows_match_the_int8_activation_reference(bits: int, group: int | None, k: int,
                                                  dtype: torch.dtype) -> None:
    # k = 320: a row shorter than its tile of 512 columns (masked runs).
    for i, cfg in enumerate(CONFIGS):
        w = int_weight(N, k, bits, group, symmetric=i == 0, act_order=i == 1)
        for m in (1, 2):
            x = activations(m, k, dtype)
            add = torch.randn(m, N, device=DEVICE, dtype=dtype)
            assert_close(int_linear_triton(x, w, config=cfg), int_gemv_ref(x, w), dtype)
            assert_close(int_linear_triton(x, w, add=add, config=cfg),
                         int_gemv_ref(x, w, add=add), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_norm_prologue_and_silu_epilogue(bits: int, dtype: torch.dtype) -> None:
    inter = 21  # odd: gate rows 0-20, up rows 21-41
    w = int_weight(2 * inter, 256, bits, 64, symmetric=False, act_order=True)
    norm = (1 + 0.1 * torch.randn(256, device=DEVICE)).to(dtype)
    for cfg in CONFIGS:
        for m in (1, 2):
            x = activations(m, 256, dtype)
            out = int_linear_triton(x, w, norm_weight=norm, eps=1e-5, silu=True, config=cfg)
            assert out.shape == (m, inter)
            assert_close(out, int_gemv_ref(x, w, norm_weight=norm, silu=True), dtype)


def test_rounding_the_activations_costs_under_a_percent() -> None:
    """Against the unrounded activations: int8 per run of 32 adds ~1/254 of a run's largest
    value to each, about 0.5% of the output, well under the 4-bit weights' own error."""
    w = int_weight(256, 512, 4, 128)
    x = activations(2, 512, torch.float32)
    exact = linear_ref(x, w.dequantize())
    err = (int_linear_triton(x, w) - exact).norm() / exact.norm()
    assert 0 < err < 1e-2


def test_a_zero_row_and_zero_runs() -> None:
    w = int_weight(N, 256, 4, 64)
    x = activations(2, 256, torch.float32)
    x[0] = 0
    x[1, :64] = 0  # two whole runs of zeros
    out = int_linear_triton(x, w)
    assert not out[0].any()
    assert_close(out, int_gemv_ref(x, w), torch.float32)


def test_which_calls_it_serves() -> None:
    assert applies(int_weight(8, 256, 4, 128), 1)
    assert applies(int_weight(8, 256, 8, None), 2)
    assert not applies(int_weight(8, 256, 4, 128), 3)  # more rows: tensor cores
    assert not applies(int_weight(8, 96, 8, 48), 1)  # groups that are not whole runs
    assert not applies(int_weight(8, 64, 4, 16), 1)
    assert not applies(int_weight(8, 100, 8, None), 1)  # rows that are not whole runs
    # Llama-3-8B's decode shapes: small programs over a few rows, 8 warps for down_proj's
    # long rows.
    assert default_config(6144, 4096, 4, False) == IntGemvConfig(block_n=8, per_sm=4,
                                                                 num_warps=4)
    assert default_config(4096, 4096, 8, False).num_warps == 8
    assert default_config(4096, 14336, 4, False).num_warps == 16
    with pytest.raises(ValueError, match="power of two"):
        IntGemvConfig(block_n=3)
