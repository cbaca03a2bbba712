"""The 8-bit-activation kernels (``csrc/q8_linear_cpu.c``) against their reference: x rounded
per row to 8-bit blocks as ``tidegate.kernels.reference.q8_activations`` defines it, then the dequantized matrix's
product in float64. Fresh random inputs each run; every quantized GGUF type and integer layout;
partial strips of 16 weight rows; 1 to 64 rows of x; with and without the residual add; each of
the compiled paths (AMX and AVX512-VNNI where the CPU has them, AVX2, portable C); the rows
layout and the lanes8 layout (8 rows side by side) that Q4_0, Q4_1 and Q8_0 are repacked to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.kernels.cpu.test_packed_linear import cols_for, random_packed
from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import int_linear_ref, packed_linear_ref
from tidegate.kernels.cpu.native_cpu import NativeBuildError, NativeCpuKernels, build
from tidegate.kernels.reference.q8_activations import dequantize_rows_q8_ref, quantize_rows_q8_ref
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import (
    LANES8,
    LANES8_TYPES,
    Q8_TYPES,
    ROWS,
    PackedWeight,
    lanes8_to_rows,
)

T = GGMLQuantizationType
TYPES = sorted(Q8_TYPES, key=int)
# vnni-rows / vnni-lanes: up to 4 rows of x weight row by weight row (AMD's choice) or through
# the gathered lanes (Intel's), whichever this CPU would take.
PATHS = {"native": (), "vnni": ("TIDEGATE_NO_AMX",),
         "vnni-rows": ("TIDEGATE_NO_AMX", "TIDEGATE_Q8_ROWS"),
         "vnni-lanes": ("TIDEGATE_NO_AMX", "TIDEGATE_Q8_LANES"),
         "avx2": ("TIDEGATE_NO_AVX512",), "portable": ("TIDEGATE_PORTABLE",)}


@pytest.fixture(scope="module", params=list(PATHS))
def q8(request: pytest.FixtureRequest, native: NativeCpuKernels) -> NativeCpuKernels:
    """The kernels as built for this machine, and as built with the slower paths forced."""
    if not PATHS[request.param]:
        return native
    try:
        lib = NativeCpuKernels(build(defines=PATHS[request.param]))
    except NativeBuildError as exc:  # e.g. AVX2 intrinsics on a CPU without them
        pytest.skip(f"{request.param} path does not build here: {exc}")
    vnni = min(native.q8_path, 2)
    assert lib.q8_path == {"vnni": vnni, "vnni-rows": vnni, "vnni-lanes": vnni, "avx2": 1,
                           "portable": 0}[request.param] or request.param == "avx2"
    # (an AVX2 build without AVX2: portable)
    return lib


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: object,
                 add: torch.Tensor | None = None) -> None:
    """``got`` against x [M, K] @ w [N, K].T (+ add) in float64: float32 sums of exact products
    err by a few float32 roundings of the sums of the products' magnitudes (each output's
    own: an output near zero is a cancellation of larger terms)."""
    x, w = x.double(), w.double()
    want = x @ w.T + (0 if add is None else add.double())
    bound = 1e-5 * (x.abs() @ w.abs().T) + 1e-12
    assert bool(((got.double() - want).abs() <= bound).all()), what


def test_rows_round_exactly_as_the_reference(q8: NativeCpuKernels) -> None:
    x = torch.randn(7, 320) * torch.logspace(-3, 3, 7)[:, None]
    x[1, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 5] = 1e4  # one block dominated by one value
    rec = q8.quantize_rows_q8(x)
    q, d = quantize_rows_q8_ref(x)
    assert rec.shape == (7, 480)
    assert torch.equal(rec[:, :320].view(torch.int8), q)
    floats = rec[:, 320:].contiguous().view(torch.float32)  # d, xs32, xs16
    assert torch.equal(floats[:, :10], d)
    sums16 = q.reshape(7, 20, 16).sum(dim=2, dtype=torch.int32)
    sums32 = sums16.reshape(7, 10, 2).sum(dim=2)
    assert torch.equal(floats[:, 10:20], d * sums32.float())
    assert torch.equal(floats[:, 20:], d.repeat_interleave(2, dim=1) * sums16.float())
    assert int(q.abs().max()) <= 127 and bool((q[1, :32] == 0).all())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 64])
def test_packed_int8_matches_rounded_x_times_dequantized(q8: NativeCpuKernels, qtype: T,
                                                        m: int) -> None:
    rng = np.random.default_rng()
    for cols in cols_for(qtype):
        for rows in (1, 7, 16, 17, 61):  # strips of 16: whole and partial
            weight = random_packed(qtype, rows, cols, rng).with_activations("int8")
            x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
            add = torch.from_numpy(rng.standard_normal((m, rows)).astype(np.float32))
            x8, deq = dequantize_rows_q8_ref(x), weight.dequantize()
            assert_close(q8.packed_linear(x, weight, add), x8, deq, (rows, cols), add)
            assert_close(q8.packed_linear(x, weight), x8, deq, (rows, cols))
            assert_close(packed_linear_ref(x.double(), weight), x8, deq, "reference")


@pytest.mark.parametrize(("bits", "group"), [(4, 16), (4, 32), (4, 128), (4, None), (8, 16),
                                             (8, 48), (8, 64), (8, None)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int_int8_matches_rounded_x_times_dequantized(q8: NativeCpuKernels, bits: int,
                                                     group: int | None, symmetric: bool) -> None:
    """Groups of 16 (and 48) take steps of 16 columns; the others steps of 32."""
    rng = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    k = 384
    for rows, m in ((1, 1), (23, 4), (40, 9), (17, 64)):
        w = IntWeight.quantize(torch.randn(rows, k, generator=rng), bits, group, symmetric)
        w = w.with_activations("int8")
        x = torch.randn(m, k, generator=rng)
        add = torch.randn(m, rows, generator=rng)
        x8, deq = dequantize_rows_q8_ref(x), w.dequantize()
        assert_close(q8.int_linear(x, w, add), x8, deq, (rows, m), add)
        assert_close(int_linear_ref(x.double(), w), x8, deq, "reference")


def test_act_order_rounds_x_in_its_stored_order(q8: NativeCpuKernels) -> None:
    w = IntWeight.quantize(torch.randn(20, 256), 4, 32, symmetric=False)
    perm = torch.randperm(256)
    w = IntWeight(w.shape, 4, 32, w.qweight, w.scales, w.zeros, perm, activations="int8")
    x = torch.randn(3, 256)
    stored = (w.ints() - w.zeros.int().repeat_interleave(32, 1)) * w.scales.repeat_interleave(
        32, 1)  # columns in stored order
    x8 = dequantize_rows_q8_ref(x[:, perm])
    assert_close(q8.int_linear(x, w), x8, stored, "act-order")
    assert_close(int_linear_ref(x.double(), w), x8, stored, "reference")


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_batch(q8: NativeCpuKernels, qtype: T) -> None:
    """Up to 4 rows use a block from registers, more go through a decoded strip (16 at a time
    through AMX tiles where the CPU has them): a row gets the same bits either way (the
    engine's outputs may not depend on who shared a step)."""
    rng = np.random.default_rng()
    cols = cols_for(qtype)[-1]
    weight = random_packed(qtype, 45, cols, rng).with_activations("int8")
    x = torch.from_numpy(rng.standard_normal((33, cols)).astype(np.float32))
    alone = torch.cat([q8.packed_linear(x[i:i + 1], weight) for i in range(33)])
    for rows in (2, 4, 5, 11, 33):
        together = torch.cat([q8.packed_linear(x[i:i + rows], weight)
                              for i in range(0, 33, rows)])
        assert torch.equal(together, alone), rows


def test_every_path_computes_the_same_bits(native: NativeCpuKernels,
                                           q8: NativeCpuKernels) -> None:
    """The arithmetic is defined step by step (csrc/q8_linear_cpu.c), so the AMX, AVX-512, AVX2
    and portable paths agree exactly, not just closely (37 rows: AMX's 16 at a time, the
    rest by vpdpbusd; 1 and 3 rows: the lanes or the weight rows one by one)."""
    rng = np.random.default_rng()
    for qtype in TYPES:
        weight = random_packed(qtype, 21, cols_for(qtype)[-1], rng).with_activations("int8")
        for m in (1, 3, 37):
            x = torch.from_numpy(rng.standard_normal((m, weight.shape[1])).astype(np.float32))
            assert torch.equal(q8.packed_linear(x, weight), native.packed_linear(x, weight)), (
                qtype, m)
    w = IntWeight.quantize(torch.randn(19, 256), 4, 16, symmetric=False).with_activations("int8")
    x = torch.randn(5, 256)
    assert torch.equal(q8.int_linear(x, w), native.int_linear(x, w))


def test_float_parts_of_a_stacked_matrix_keep_float_activations(native: NativeCpuKernels
                                                                ) -> None:
    rng = np.random.default_rng()
    q, v = random_packed(T.Q4_K, 12, 256, rng), random_packed(T.F16, 6, 256, rng)
    both = PackedWeight.cat([q, v]).with_activations("int8")
    x = torch.randn(3, 256)
    got = native.packed_linear(x, both)
    assert_close(got[:, :12], dequantize_rows_q8_ref(x), q.dequantize(), "Q4_K")
    assert_close(got[:, 12:], x, v.dequantize(), "F16")
    assert torch.equal(ops.linear(x, both), got)
    torch.testing.assert_close(packed_linear_ref(x, both), got, rtol=1e-4, atol=1e-4)


def test_rows_not_in_blocks_of_32_take_float_activations(native: NativeCpuKernels) -> None:
    w = IntWeight.quantize(torch.randn(8, 48), 8, None).with_activations("int8")
    assert not w.takes_int8
    x = torch.randn(2, 48)
    torch.testing.assert_close(native.int_linear(x, w), int_linear_ref(x, w))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        native.quantize_rows_q8(x)


def test_an_unknown_activation_mode_is_refused() -> None:
    w = random_packed(T.Q8_0, 4, 32, np.random.default_rng())
    with pytest.raises(ValueError, match="activations must be one of float, int8"):
        w.with_activations("int4")
    with pytest.raises(ValueError, match="activations must be one of float, int8"):
        IntWeight.quantize(torch.randn(4, 32), 8).with_activations("fp8")


@pytest.mark.parametrize("qtype", sorted(LANES8_TYPES, key=int), ids=lambda t: t.name)
def test_lanes8_gives_the_rows_layouts_bits(native: NativeCpuKernels, q8: NativeCpuKernels,
                                            qtype: T) -> None:
    """Repacked 8 rows to a group, a matrix holds the same bytes (the reference un-repacks
    them) and every path computes the rows layout's bits from it: one row of x (decode), a
    few, and more than a pass over a group takes (32), with and without the add."""
    rng = np.random.default_rng()
    for rows, cols in ((8, 32), (24, 224), (64, 576)):
        weight = random_packed(qtype, rows, cols, rng).with_activations("int8")
        packed = q8.repack_lanes8(weight, force=True)
        part = packed.parts[0]
        assert part.layout == LANES8 and part.data.shape == weight.parts[0].data.shape
        assert np.array_equal(lanes8_to_rows(part.data.numpy(), qtype, cols),
                              weight.parts[0].data.numpy())
        for m in (1, 3, 4, 9, 40):
            x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
            add = torch.from_numpy(rng.standard_normal((m, rows)).astype(np.float32))
            want = native.packed_linear(x, weight, add)
            assert torch.equal(q8.packed_linear(x, packed, add), want), (rows, cols, m)
            assert_close(q8.packed_linear(x, packed), dequantize_rows_q8_ref(x),
                         weight.dequantize(), (rows, cols, m))


def test_a_lanes8_matrix_reads_as_its_rows(native: NativeCpuKernels) -> None:
    """Embedding lookups (a tied LM head's matrix), the references and float activations read
    a repacked matrix's rows as the file's; stacking and permuting come before repacking."""
    rng = np.random.default_rng()
    weight = random_packed(T.Q8_0, 40, 96, rng).with_activations("int8")
    packed = native.repack_lanes8(weight, force=True)
    ids = torch.tensor([0, 7, 8, 39, 8, 21])
    rows = weight.dequantize()[ids]
    assert torch.equal(native.dequantize_rows(packed, ids), rows)
    assert torch.equal(ops.embedding(ids, packed), rows)
    assert torch.equal(packed.dequantize_rows(ids), rows)
    assert torch.equal(packed.dequantize(), weight.dequantize())
    floats = packed.with_activations("float")
    assert floats.parts[0].layout == ROWS
    assert torch.equal(floats.parts[0].data, weight.parts[0].data)
    x = torch.randn(2, 96)
    assert torch.equal(native.packed_linear(x, floats),
                       native.packed_linear(x, weight.with_activations("float")))
    with pytest.raises(ValueError, match="stack the rows, then repack"):
        PackedWeight.cat([packed, weight])
    with pytest.raises(ValueError, match="permute, then repack"):
        packed.permute_rows(torch.arange(40).flip(0))


def test_only_what_lanes8_holds_is_repacked(native: NativeCpuKernels) -> None:
    """Rows not whole groups of 8, types without the layout, float activations and Q8_0 codes
    of -128 (AVX2's sign trick cannot take them) stay in rows."""
    rng = np.random.default_rng()
    for weight in (random_packed(T.Q4_0, 12, 64, rng), random_packed(T.Q4_K, 16, 256, rng),
                   random_packed(T.Q5_1, 16, 64, rng)):
        kept = native.repack_lanes8(weight.with_activations("int8"), force=True)
        assert kept.parts[0].layout == ROWS
    assert native.repack_lanes8(random_packed(T.Q4_1, 16, 64, rng), force=True
                                ).parts[0].layout == ROWS  # float activations
    q8_0 = random_packed(T.Q8_0, 16, 64, rng).with_activations("int8")
    raw = q8_0.parts[0].data.clone()
    raw[5, 2 + 34 + 7] = 0x80  # row 5, block 1, code 7: -128
    odd = PackedWeight.from_bytes(T.Q8_0, (16, 64), raw).with_activations("int8")
    assert native.repack_lanes8(odd, force=True).parts[0].layout == ROWS
    x = torch.randn(1, 64)
    assert_close(native.packed_linear(x, odd), dequantize_rows_q8_ref(x), odd.dequantize(), "-128")
    # What this CPU prefers: the loader repacks these and only these.
    preferred = native.repack_lanes8(q8_0).parts[0].layout == LANES8
    assert preferred == native.lanes8_preferred(T.Q8_0)
