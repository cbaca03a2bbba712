"""Integer weights with group scales (``tidegate.kernels.weights.int_weight``) and their CPU kernel
(``csrc/packed_linear_cpu.c``, ``tidegate_int_linear_f32``) against the reference:
dequantize, then the float matmul. The layout is checked against integers unpacked here from
its definition, so a packing bug cannot cancel out. Fresh random inputs each run."""

from __future__ import annotations

import pytest
import torch

from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import int_linear_ref
from tidegate.kernels.weights.int_weight import IntWeight, pack, rtn, unpack


def random_int(n: int, k: int, bits: int, group: int | None, perm: bool = False) -> IntWeight:
    groups = 1 if group is None else k // group
    q = torch.randint(0, 1 << bits, (n, k))
    scales = torch.rand(n, groups) * 0.1 + 0.01
    zeros = torch.randint(0, 1 << bits, (n, groups))
    order = torch.randperm(k) if perm else None
    return IntWeight.from_ints(q, scales, zeros, bits, perm=order)


def test_four_bit_layout_is_ggml_runs_of_32() -> None:
    q = torch.randint(0, 16, (3, 64))
    packed = pack(q, 4)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    for run in range(2):
        byte = packed[:, 16 * run:16 * (run + 1)].to(torch.int32)
        assert torch.equal(byte & 0xF, q[:, 32 * run:32 * run + 16])
        assert torch.equal(byte >> 4, q[:, 32 * run + 16:32 * run + 32])
    assert torch.equal(unpack(packed, 4, 64), q)
    assert torch.equal(unpack(pack(q * 16 + 3, 8), 8, 64), q * 16 + 3)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_follows_its_definition(bits: int) -> None:
    w = random_int(5, 128, bits, 32, perm=True)
    q = w.ints()
    by_stored = (q - w.zeros.to(torch.int32).repeat_interleave(32, 1)).float() * (
        w.scales.repeat_interleave(32, 1))
    assert torch.equal(w.dequantize()[:, w.perm], by_stored)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [None, 32, 64])
def test_round_to_nearest_error_is_half_a_step(bits: int, symmetric: bool,
                                               group: int | None) -> None:
    w = torch.randn(16, 256)
    q = IntWeight.quantize(w, bits, group, symmetric)
    step = q.scales.repeat_interleave(q.group_size, 1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    ints, _, zeros = rtn(w, bits, group, symmetric)
    assert int(ints.min()) >= 0 and int(ints.max()) < 1 << bits
    if symmetric:
        assert (zeros == 1 << (bits - 1)).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [None, 16, 32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 33])
@pytest.mark.parametrize("perm", [False, True])
def test_native_kernel_matches_reference(native, bits: int, group: int | None, m: int,  # noqa: ANN001
                                         perm: bool) -> None:
    n, k = 29, 256  # partial strips of 6 and 24 rows
    w = random_int(n, k, bits, group, perm)
    x = torch.randn(m, k + 8)[:, :k]  # a strided view
    add = torch.randn(m, n)
    # Weights up to +-28 against 256 columns: float32 sums of ~3000 in magnitude, which two
    # summation orders round apart by up to ~3e-4.
    torch.testing.assert_close(native.int_linear(x, w), int_linear_ref(x, w),
                               rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(ops.linear(x, w, add=add), int_linear_ref(x, w, add),
                               rtol=1e-5, atol=1e-3)


def test_rows_do_not_depend_on_the_batch(native) -> None:  # noqa: ANN001
    """A row's result is the same whether its step had 1 or 40 rows (greedy decoding of a
    sequence must not change with the batch around it)."""
    w = random_int(50, 192, 4, 64)
    x = torch.randn(40, 192)
    alone = torch.cat([native.int_linear(x[i:i + 1], w) for i in range(40)])
    assert torch.equal(native.int_linear(x, w), alone)


def test_fused_matrices_stack_and_refuse_mixed_groups() -> None:
    a, b = random_int(8, 64, 4, 32), random_int(4, 64, 4, 32)
    both = IntWeight.cat([a, b])
    assert both.shape == (12, 64)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="differ"):
        IntWeight.cat([a, random_int(4, 64, 4, None)])
    with pytest.raises(ValueError, match="differ"):
        IntWeight.cat([random_int(4, 64, 4, 32, perm=True), random_int(4, 64, 4, 32, perm=True)])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"bits": 3}, "3-bit"),
    ({"cols": 48}, "runs of 32"),
    ({"groups": 5}, "do not divide"),
])
def test_bad_layouts_are_refused(kwargs: dict[str, int], match: str) -> None:
    bits, cols, groups = kwargs.get("bits", 4), kwargs.get("cols", 64), kwargs.get("groups", 2)
    with pytest.raises(ValueError, match=match):
        IntWeight.from_ints(torch.zeros(2, cols, dtype=torch.int32), torch.ones(2, groups),
                            torch.zeros(2, groups, dtype=torch.int32), bits)


def test_values_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="0..15"):
        IntWeight.from_ints(torch.full((2, 32), 16), torch.ones(2, 1),
                            torch.zeros(2, 1, dtype=torch.int32), 4)
