"""ops.linear on every path (native few-row kernel, transposed BLAS, F.linear): the product
in float64 to float32 rounding, contiguous, at any size and row stride."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tidegate.kernels.cpu.native_cpu as native_cpu
from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import NATIVE_ROWS, SKINNY_ROWS


def close_to_float64(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    assert out.dtype == torch.float32
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 1e-6, f"relative error {rel:.2e}"
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


@pytest.fixture(params=["native", "reference"])
def kernel_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(native_cpu, "_loaded", {})
    monkeypatch.setenv("TIDEGATE_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, 4, 7, NATIVE_ROWS, NATIVE_ROWS + 1, SKINNY_ROWS,
                                  SKINNY_ROWS + 1, 300])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (576, 1536), (49, 16), (13, 37)])
def test_linear_matches_float64(rows: int, n: int, k: int, kernel_mode: str) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    out = ops.linear(x, w)
    assert out.shape == (rows, n) and out.is_contiguous()
    close_to_float64(out, x, w)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_native_kernel_reads_strided_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """x as a column slice of a wider tensor (row stride > K), as a split output would be."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    gen = torch.Generator().manual_seed(rows)
    wide, w = torch.randn(rows, 700, generator=gen), torch.randn(83, 576, generator=gen)
    x = wide[:, 50:626]
    assert x.stride(0) == 700
    lib = native_cpu.native_kernels()
    assert lib is not None
    out = lib.skinny_linear(x, w)
    close_to_float64(out, x, w)


def test_native_kernel_writes_every_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output element is right at row and column counts that leave every remainder of
    the kernel's 4-row by 6-column tiles (an unwritten one would hold garbage)."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    lib = native_cpu.native_kernels()
    assert lib is not None
    gen = torch.Generator().manual_seed(7)
    for rows in range(1, 10):
        for n in range(1, 14):
            x, w = torch.randn(rows, 40, generator=gen), torch.randn(n, 40, generator=gen)
            close_to_float64(lib.skinny_linear(x, w), x, w)


def test_native_kernel_refuses_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_KERNELS", "native")
    lib = native_cpu.native_kernels()
    assert lib is not None
    with pytest.raises(ValueError, match="float32"):
        lib.skinny_linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(3, 8))
    with pytest.raises(ValueError, match="does not fit"):
        lib.skinny_linear(torch.randn(2, 8), torch.randn(3, 9))
    # bfloat16 (and any other dtype) goes around the native kernel in ops.linear
    x, w = torch.randn(3, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w))
