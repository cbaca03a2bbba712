"""FP8 weights scaled per row (``tidegate.kernels.weights.fp8_weight``) and their CPU kernel
(``csrc/packed_linear_cpu.c``, ``tidegate_fp8_linear_f32``: weight-only, float32 activations)
against the reference: dequantize, then the float matmul. Every e4m3 code is widened exactly;
fresh random inputs each run, shapes with partial tiles (6 rows) and strips (24 rows)."""

from __future__ import annotations

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import fp8_linear_ref
from tidegate.kernels.weights.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Weight

# Every e4m3fn byte but the two NaNs (S.1111.111): zeros, subnormals, normals up to +-448.
CODES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def random_fp8(n: int, k: int) -> Fp8Weight:
    """Random bytes over the whole e4m3 range (not just what rounding a Gaussian gives) and
    positive scales."""
    q = CODES[torch.randint(0, CODES.numel(), (n, k))]
    return Fp8Weight((n, k), q.view(FP8_DTYPE), torch.rand(n) * 0.01 + 0.001)


def test_every_code_is_widened_exactly(native) -> None:  # noqa: ANN001
    """x = I reads each weight back alone: the kernel's float of every e4m3 code times its
    row's scale is torch's, to the bit."""
    q = torch.stack([CODES, CODES.flip(0), CODES.roll(7)]).contiguous()
    w = Fp8Weight((3, CODES.numel()), q.view(FP8_DTYPE), torch.tensor([1.0, 0.37, 3e-3]))
    got = native.fp8_linear(torch.eye(CODES.numel()), w).t()
    assert torch.equal(got, w.dequantize())
    assert w.dequantize()[0].abs().max().item() == FP8_MAX


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 33, 48, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (7, 100), (29, 256), (61, 576)])
def test_native_kernel_matches_reference(native, m: int, n: int, k: int) -> None:  # noqa: ANN001
    w = random_fp8(n, k)
    x = torch.randn(m, k + 8)[:, :k]  # a strided view
    add = torch.randn(m, n)
    # Weights up to +-4.9 against up to 576 columns: float32 sums of ~100 in magnitude, which
    # two summation orders round apart by ~1e-5.
    want = fp8_linear_ref(x.double(), w, add.double()).float()
    torch.testing.assert_close(native.fp8_linear(x, w, add), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(native.fp8_linear(x, w), fp8_linear_ref(x, w), rtol=1e-5,
                               atol=1e-4)


def test_ops_linear_routes_fp8_to_the_native_kernel(native) -> None:  # noqa: ANN001
    w = random_fp8(29, 64)
    x, add = torch.randn(5, 64), torch.randn(5, 29)
    assert torch.equal(ops.linear(x, w, add=add), native.fp8_linear(x, w, add))
    norm = torch.rand(64) + 0.5
    normed = ops.rms_norm(x, norm, 1e-5)[0]
    assert torch.equal(ops.norm_linear(x, norm, 1e-5, w), native.fp8_linear(normed, w))


def test_without_the_native_kernel_fp8_takes_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``reference`` (the Triton kernels are tests/kernels/gpu/test_fp8_linear_triton.py's)."""
    monkeypatch.setenv("TIDEGATE_KERNELS", "reference")
    w = random_fp8(7, 32)
    x, add = torch.randn(3, 32), torch.randn(3, 7)
    assert torch.equal(ops.linear(x, w, add=add), fp8_linear_ref(x, w, add))


def test_rows_do_not_depend_on_the_batch(native) -> None:  # noqa: ANN001
    """A row's result is the same whether its step had 1 or 40 rows (greedy decoding of a
    sequence must not change with the batch around it)."""
    w = random_fp8(50, 192)
    x = torch.randn(40, 192)
    alone = torch.cat([native.fp8_linear(x[i:i + 1], w) for i in range(40)])
    assert torch.equal(native.fp8_linear(x, w), alone)


def test_quantize_puts_each_rows_largest_value_on_448() -> None:
    w = torch.randn(16, 96)
    w[3] = 0.0  # an all-zero row keeps scale 1
    q = Fp8Weight.quantize(w)
    assert q.types == ("fp8-e4m3-channel",) and q.nbytes == 16 * 96 + 16 * 4
    peak = (q.weight.float().abs().amax(dim=1))
    assert torch.equal(peak[torch.arange(16) != 3], torch.full((15,), FP8_MAX))
    assert q.scales[3].item() == 1.0
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 of each value (and within
    # half the smallest subnormal step near zero).
    err = (q.dequantize() - w).abs()
    assert (err <= w.abs() / 16 + q.scales[:, None] * 2.0 ** -10).all()


def test_fused_matrices_stack_and_refuse_other_widths() -> None:
    a, b = random_fp8(8, 64), random_fp8(4, 64)
    both = Fp8Weight.cat([a, b])
    assert both.shape == (12, 64)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="differ in columns"):
        Fp8Weight.cat([a, random_fp8(4, 32)])


@pytest.mark.parametrize(("weight", "scales", "match"), [
    (torch.zeros(2, 8), torch.ones(2), "weight must be torch.float8_e4m3fn"),
    (torch.zeros(2, 8, dtype=FP8_DTYPE), torch.ones(2, 1), r"scales must be torch.float32 \[2\]"),
])
def test_bad_layouts_are_refused(weight: torch.Tensor, scales: torch.Tensor,
                                 match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fp8Weight((2, 8), weight, scales)
