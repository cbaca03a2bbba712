"""The integer-weight Triton projection (``tidegate.kernels.gpu.int_linear_triton``) against the dequantized
matrix through the plain-torch references: 4 and 8 bits, groups of 32, 64 and the whole row
(and the group sizes that are no power of two), symmetric and asymmetric, with and without
act-order, on the FMA path (1-2 rows, asked for by its config, or where the integer-dot GEMV
does not apply) and the tensor-core path (partial row and column tiles), with the RMSNorm
prologue, the SiLU-and-mul epilogue and the residual add; then the tiles' choice and the
wrapper's refusals. The integer-dot GEMV that serves 1-2 rows by default is
``tests/kernels/gpu/test_int_gemv_triton.py``.

Without CUDA they run in Triton's interpreter (small shapes, float32 and float16; bfloat16 and
the model's shapes are in ``tests/gpu/test_gpu_int_linear.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tidegate.kernels.cpu.linear import linear_ref, norm_linear_ref
from tidegate.kernels.gpu.int_linear_triton import (
    IntLinearConfig,
    default_config,
    int_linear_triton,
)
from tidegate.kernels.weights.int_weight import IntWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
K = 192  # runs of 32, groups of 32 and 64, or one group of 192 (not a power of two)
N = 40  # no multiple of any block_n the tiles use
FMA = IntLinearConfig(block_n=4, block_k=64)  # the FMA path for 1-2 rows, activations as they are


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float16: the kernel rounds in other places than the reference (float32 dequantized
    # weights on the FMA path, 1/rms applied to the finished sums), a few ulps.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-3, "atol": 3e-3}
    assert out.dtype == want.dtype and out.shape == want.shape and out.is_contiguous()
    torch.testing.assert_close(out, want, **tol)


def int_weight(n: int, k: int, bits: int, group: int | None, symmetric: bool = True,
               act_order: bool = False) -> IntWeight:
    w = IntWeight.quantize(torch.randn(n, k) / k**0.5, bits, group, symmetric).to(DEVICE)
    return dataclasses.replace(w, perm=torch.randperm(k, device=DEVICE)) if act_order else w


def activations(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    # A strided view (a padded row stride), as a slice of a larger activation would be.
    return torch.randn(m, k + 8, device=DEVICE, dtype=dtype)[:, :k]


def reference(x: torch.Tensor, w: IntWeight, add: torch.Tensor | None = None) -> torch.Tensor:
    return linear_ref(x, w.dequantize().to(x.dtype), add)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, None])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_on_both_paths_match_the_dequantized_matrix(bits: int, group: int | None,
                                                         dtype: torch.dtype) -> None:
    # 1-2 rows: FMA (2 rows in steps of 64 columns); 5 and 33: tensor cores, 33 leaving a
    # partial row tile. Act-order and asymmetric zeros on half of them.
    for m, act_order, cfg in ((1, False, IntLinearConfig()),
                              (2, True, IntLinearConfig(block_n=8, block_k=64)),
                              (5, False, None), (33, True, None)):
        w = int_weight(N, K, bits, group, symmetric=group != 32, act_order=act_order)
        x = activations(m, K, dtype)
        add = torch.randn(m, N, device=DEVICE, dtype=dtype)
        assert_close(int_linear_triton(x, w, config=cfg), reference(x, w), dtype)
        assert_close(int_linear_triton(x, w, add=add, config=cfg), reference(x, w, add), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_norm_prologue_and_silu_epilogue(bits: int, dtype: torch.dtype) -> None:
    inter = 21  # odd, and no multiple of a block: gate rows 0-20, up rows 21-41
    w = int_weight(2 * inter, K, bits, 64, symmetric=False, act_order=True)
    norm = (1 + 0.1 * torch.randn(K, device=DEVICE)).to(dtype)
    for m in (1, 2, 5):
        x = activations(m, K, dtype)
        want = norm_linear_ref(x, norm, 1e-5, w.dequantize().to(dtype), silu=True)
        out = int_linear_triton(x, w, norm_weight=norm, eps=1e-5, silu=True,
                                config=FMA if m <= 2 else None)
        assert_close(out, want, dtype)
    x = activations(2, K, dtype)
    want = norm_linear_ref(x, norm, 1e-5, w.dequantize().to(dtype))
    assert_close(int_linear_triton(x, w, norm_weight=norm, eps=1e-5, config=FMA), want, dtype)


@pytest.mark.parametrize(("bits", "group", "k"), [
    (8, 48, 96),  # 16 x 3: steps of 16 columns
    (4, 96, 192),  # 32 x 3: steps of one 32-column run
    (4, 16, 64),  # a run's two nibble halves in two groups
    (8, None, 100),  # one group of a row no multiple of 16
])
def test_group_sizes_that_are_no_power_of_two(bits: int, group: int | None, k: int) -> None:
    w = int_weight(N, k, bits, group, symmetric=False)
    for m in (1, 5):
        x = activations(m, k, torch.float32)
        assert_close(int_linear_triton(x, w), reference(x, w), torch.float32)


@pytest.mark.parametrize("cfg", [
    IntLinearConfig(block_n=2, block_k=32),  # FMA, one 32-column run a step
    IntLinearConfig(block_n=16, block_k=256, num_warps=8),  # FMA, a step past the row's end
    IntLinearConfig(block_m=16, block_n=16, block_k=32, dot=True),  # dot, 16-column halves
    IntLinearConfig(block_m=64, block_n=64, block_k=64, dot=True, group_m=1),
], ids=["fma-n2", "fma-n16", "dot-small", "dot-wide"])
@pytest.mark.parametrize("bits", [4, 8])
def test_explicit_tiles(cfg: IntLinearConfig, bits: int) -> None:
    w = int_weight(N, K, bits, 64, symmetric=False, act_order=True)
    x = activations(2 if not cfg.dot else 17, K, torch.float32)
    assert_close(int_linear_triton(x, w, config=cfg), reference(x, w), torch.float32)


def test_zero_rows() -> None:
    w = int_weight(2 * 24, K, 4, 32)
    x = activations(0, K, torch.float16)
    assert int_linear_triton(x, w).shape == (0, 48)
    out = int_linear_triton(x, w, silu=True, add=torch.empty(0, 24, device=DEVICE))
    assert out.shape == (0, 24) and out.dtype == torch.float16


def test_default_tiles_follow_the_shape() -> None:
    # Decode on Llama-3-8B: FMA programs of a few rows; prefill: tensor-core tiles.
    qkv = default_config(1, 6144, 4096, 128, 4)
    assert not qkv.dot and qkv.block_k * 4 // 8 == 512  # 512 bytes of each row a step
    assert default_config(2, 4096, 14336, 128, 4).block_k == 2048
    assert default_config(1, 4096, 4096, 4096, 8) == IntLinearConfig(block_n=4, block_k=512)
    assert default_config(1, 48, 96, 96, 8).block_k == 128  # a short row in one step
    assert default_config(3, 4096, 4096, 128, 4).dot
    assert default_config(4096, 4096, 4096, 128, 4).block_m == 64


def test_wrapper_rejects_bad_inputs() -> None:
    w = int_weight(32, 64, 4, 32)
    x = activations(2, 64, torch.float32)
    with pytest.raises(ValueError, match="x must have shape"):
        int_linear_triton(activations(2, 96, torch.float32), w)
    with pytest.raises(ValueError, match="2-D"):
        int_linear_triton(x[None], w)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        int_linear_triton(x.double(), w)
    with pytest.raises(ValueError, match="qweight must be on meta"):
        int_linear_triton(x.to("meta"), w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        int_linear_triton(torch.randn(64, 2, device=DEVICE).t(), w)
    with pytest.raises(ValueError, match="an IntWeight"):
        int_linear_triton(x, torch.randn(32, 64, device=DEVICE))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="odd 31 rows"):
        int_linear_triton(x, int_weight(31, 64, 8, None), silu=True)
    with pytest.raises(ValueError, match="add must have shape"):
        int_linear_triton(x, w, add=torch.randn(2, 31, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        int_linear_triton(x, w, norm_weight=torch.ones(63, device=DEVICE))
    with pytest.raises(ValueError, match="at most 2"):
        int_linear_triton(activations(3, 64, torch.float32), w,
                          config=IntLinearConfig(block_n=4, block_k=64))
    with pytest.raises(ValueError, match="whole runs of 32"):
        int_linear_triton(x, w, config=IntLinearConfig(block_n=4, block_k=16))
    with pytest.raises(ValueError, match="power of two"):
        IntLinearConfig(block_n=3)
