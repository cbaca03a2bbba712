"""The few-row Triton projection (``tidegate.kernels.gpu.linear_triton``) against its plain-torch references:
plain, with the RMSNorm prologue, the SiLU-and-mul epilogue and the residual add, for every tile
variant (whole-row FMA, FMA with partial sums kept, tensor-core dot) and for row counts, widths
and depths that leave partial tiles.

Without CUDA they run in Triton's interpreter (small shapes, float32 and float16; bfloat16 and
the model's shapes are in ``tests/gpu/test_gpu_linear.py``).
"""

from __future__ import annotations

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import linear_ref, norm_linear_ref
from tidegate.kernels.gpu.linear_triton import (
    MAX_ROWS,
    SkinnyConfig,
    default_config,
    skinny_linear_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
CONFIGS = {
    "fma": SkinnyConfig(block_n=4, block_k=64, dot=False),
    "fma-acc3": SkinnyConfig(block_n=8, block_k=32, dot=False, acc3=True),
    "dot": SkinnyConfig(block_n=16, block_k=32, dot=True),
    # Persistent programs (4 "SMs" in the interpreter, 1 program each) looping over blocks:
    # whole rows in one tile, and rows in several tiles.
    "persistent-one-shot": SkinnyConfig(block_n=2, block_k=128, dot=False, persistent=1),
    "persistent-k-loop": SkinnyConfig(block_n=4, block_k=32, dot=False, persistent=1),
}


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float16: the fused kernel rounds in other places than the unfused reference (1/rms scales
    # the finished sums), a few ulps.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-3, "atol": 3e-3}
    assert out.dtype == want.dtype and out.shape == want.shape
    torch.testing.assert_close(out, want, **tol)


def inputs(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # x as a strided view (a padded row stride), as a slice of a larger activation would be.
    x = torch.randn(m, k + 8, device=DEVICE, dtype=dtype)[:, :k]
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    norm = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    return x, weight, norm


@pytest.mark.parametrize("dtype", DTYPES)
# The FMA variants hold every row in registers: they serve 1-2 rows.
@pytest.mark.parametrize(("variant", "m"), [
    ("fma", 1), ("fma", 2), ("fma-acc3", 1), ("fma-acc3", 2), ("dot", 1), ("dot", 3),
    ("persistent-one-shot", 1), ("persistent-one-shot", 2), ("persistent-k-loop", 1),
    ("persistent-k-loop", 2)])
def test_plain_and_residual_add(variant: str, m: int, dtype: torch.dtype) -> None:
    cfg = CONFIGS[variant]
    x, weight, _ = inputs(m, 40, 100, dtype)  # 40 % 16, 100 % 64: partial tiles both ways
    add = torch.randn(m, 40, device=DEVICE, dtype=dtype)
    assert_close(skinny_linear_triton(x, weight, config=cfg), linear_ref(x, weight), dtype)
    assert_close(skinny_linear_triton(x, weight, add=add, config=cfg),
                 linear_ref(x, weight, add), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", CONFIGS)
@pytest.mark.parametrize("silu", [False, True])
def test_norm_prologue_and_silu_epilogue(variant: str, silu: bool, dtype: torch.dtype) -> None:
    cfg = CONFIGS[variant]
    m = 2 if not cfg.dot else 5  # the FMA variants serve 1-2 rows
    x, weight, norm = inputs(m, 2 * 24, 96, dtype)  # silu: 24 gate rows, then 24 up rows
    out = skinny_linear_triton(x, weight, norm_weight=norm, eps=1e-5, silu=silu, config=cfg)
    assert_close(out, norm_linear_ref(x, norm, 1e-5, weight, silu), dtype)


@pytest.mark.parametrize("m", [1, 2, 7, MAX_ROWS])
def test_default_tiles_at_every_row_count(m: int) -> None:
    x, weight, norm = inputs(m, 72, 300, torch.float32)
    assert_close(skinny_linear_triton(x, weight, norm_weight=norm, silu=True),
                 norm_linear_ref(x, norm, 1e-5, weight, True), torch.float32)


def test_default_tiles_follow_the_shape() -> None:
    # Whole rows for K <= 4096 in persistent programs, steps of 2048 beyond.
    assert default_config(1, 4096, 4096) == SkinnyConfig(
        block_n=2, block_k=4096, num_warps=4, num_stages=1, dot=False, persistent=4)
    assert default_config(1, 14336, 4096, silu=True).block_n == 1
    assert default_config(1, 128256, 4096).persistent == 0  # the LM head
    assert default_config(1, 4096, 14336).block_k == 2048
    assert default_config(1, 4096, 576).block_k == 1024
    assert default_config(8, 4096, 4096).dot


def test_ops_route_one_row_to_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import tidegate.kernels.gpu.linear_triton as linear_triton

    monkeypatch.setenv("TIDEGATE_KERNELS", "triton")
    calls = []
    real = linear_triton.skinny_linear_triton
    monkeypatch.setattr(linear_triton, "skinny_linear_triton",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 4):
        x, weight, norm = inputs(m, 32, 64, torch.float32)
        add = torch.randn(m, 32, device=DEVICE)
        assert_close(ops.linear(x, weight, add=add), linear_ref(x, weight, add), torch.float32)
        assert_close(ops.norm_linear(x, norm, 1e-5, weight, silu=True),
                     norm_linear_ref(x, norm, 1e-5, weight, True), torch.float32)
    assert calls == [1, 1]  # four rows go to the GEMM library's path


def test_wrapper_rejects_bad_inputs() -> None:
    x, weight, norm = inputs(2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="at most 16"):
        skinny_linear_triton(torch.randn(MAX_ROWS + 1, 64, device=DEVICE), weight)
    with pytest.raises(ValueError, match="weight must have shape"):
        skinny_linear_triton(x, torch.randn(32, 65, device=DEVICE))
    with pytest.raises(ValueError, match="odd 31 rows"):
        skinny_linear_triton(x, weight[:31], silu=True)
    with pytest.raises(ValueError, match="add must have shape"):
        skinny_linear_triton(x, weight, add=torch.randn(2, 31, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        skinny_linear_triton(x, weight, norm_weight=norm[:10])
    with pytest.raises(ValueError, match="contiguous last dim"):
        skinny_linear_triton(x, weight.t().contiguous().t())
    with pytest.raises(ValueError, match="2-D"):
        skinny_linear_triton(x[None], weight)
