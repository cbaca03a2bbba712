"""The packed GGUF kernels (``csrc/packed_linear_cpu.c``) against their reference: dequantize
with gguf-py (llama.cpp's definitions), then the float matmul. Fresh random inputs each run,
shapes with partial tiles and strips, every packed type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import packed_linear_ref
from tidegate.kernels.weights.packed_weight import (
    PACKED_TYPES,
    PackedWeight,
    UnsupportedType,
    row_bytes,
)

T = GGMLQuantizationType
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
TYPES = sorted(PACKED_TYPES, key=int)


def random_packed(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> PackedWeight:
    """A random matrix in ``qtype``: quantized by gguf-py where it can, else random blocks with
    sane scales (gguf-py has no K-quant quantizer; any bytes are valid K-quant data but the
    half-float scales, which must be finite)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in K_QUANTS:
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        scales = (rng.standard_normal((rows, cols // block, 2)) * 0.01).astype(np.float16)
        if qtype == T.Q6_K:
            raw[:, :, 208:210] = scales[:, :, :1].view(np.uint8)
        else:
            raw[:, :, 0:4] = scales.view(np.uint8).reshape(rows, cols // block, 4)
        return PackedWeight.from_bytes(qtype, (rows, cols), raw)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == T.F32:
        return PackedWeight.from_bytes(qtype, (rows, cols), values.view(np.uint8))
    packed = np.ascontiguousarray(quantize(values, qtype)).view(np.uint8)
    return PackedWeight.from_bytes(qtype, (rows, cols), packed)


def cols_for(qtype: T) -> list[int]:
    block = GGML_QUANT_SIZES[qtype][0]
    if block == 1:  # F32, F16, BF16
        return [16, 45, 576]
    return [block, 3 * block] if block == 256 else [block, 7 * block, 18 * block]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 64])
def test_packed_linear_matches_dequantize_then_matmul(native, qtype: T, m: int) -> None:  # noqa: ANN001
    rng = np.random.default_rng()
    for cols in cols_for(qtype):
        for rows in (1, 7, 25, 61):  # tiles of 6 rows, strips of 24: partial ones too
            weight = random_packed(qtype, rows, cols, rng)
            x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
            add = torch.from_numpy(rng.standard_normal((m, rows)).astype(np.float32))
            want = packed_linear_ref(x.double(), weight, add.double())
            got = native.packed_linear(x, weight, add)
            # float32 sums err by a few roundings of the sum of the products' magnitudes, each
            # output its own (one near zero is a cancellation of larger terms)
            bound = 1e-5 * (x.double().abs() @ weight.dequantize().double().abs().T + add.abs())
            assert bool(((got.double() - want).abs() <= bound).all()), (rows, cols)
            plain = native.packed_linear(x, weight)  # no add: the same products
            assert bool(((plain + add - got).abs() <= bound).all())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_dequantize_exactly_as_llama_cpp(native, qtype: T) -> None:  # noqa: ANN001
    rng = np.random.default_rng()
    cols = cols_for(qtype)[-1]
    weight = random_packed(qtype, 40, cols, rng)
    ids = torch.from_numpy(rng.integers(0, 40, size=23))
    reference = weight.dequantize()
    assert torch.equal(native.dequantize_rows(weight, ids), reference[ids])
    assert torch.equal(weight.dequantize_rows(ids), reference[ids])  # the reference path
    assert torch.equal(ops.embedding(ids, weight), reference[ids])


def test_a_strided_input_row_is_read_in_place(native) -> None:  # noqa: ANN001
    rng = np.random.default_rng()
    weight = random_packed(T.Q4_1, 30, 64, rng)
    wide = torch.randn(5, 200)
    x = wide[:, 10:74]  # row stride 200
    assert torch.allclose(native.packed_linear(x, weight),
                          packed_linear_ref(x.contiguous(), weight), rtol=1e-5, atol=1e-4)


def test_stacked_matrices_of_several_types_compute_each_part(native) -> None:  # noqa: ANN001
    """Q4_K_M stores v (and down) as Q6_K beside Q4_K q and k: one fused qkv of three parts."""
    rng = np.random.default_rng()
    q, k, v = (random_packed(t, r, 256, rng) for t, r in ((T.Q4_K, 12), (T.Q4_K, 6), (T.Q6_K, 6)))
    qkv = PackedWeight.cat([q, k, v])
    assert qkv.shape == (24, 256) and qkv.types == ("Q4_K", "Q6_K")  # q and k merged
    x = torch.randn(3, 256)
    want = torch.cat([packed_linear_ref(x, w) for w in (q, k, v)], dim=1)
    assert torch.allclose(ops.linear(x, qkv), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    with pytest.raises(ValueError, match="columns"):
        PackedWeight.cat([q, random_packed(T.Q8_0, 4, 64, rng)])


def test_permuted_rows_move_with_their_blocks() -> None:
    rng = np.random.default_rng()
    weight = random_packed(T.Q5_0, 8, 64, rng)
    order = torch.tensor([7, 0, 6, 1, 5, 2, 4, 3])
    assert torch.equal(weight.permute_rows(order).dequantize(), weight.dequantize()[order])


def test_packed_weights_keep_their_bytes() -> None:
    weight = random_packed(T.Q4_1, 576, 1536, np.random.default_rng())
    assert weight.nbytes == 576 * 1536 // 32 * 20  # 0.625 bytes per weight, as in the file


def test_unimplemented_or_ragged_types_are_refused() -> None:
    with pytest.raises(UnsupportedType, match="IQ2_XXS is not implemented"):
        row_bytes(T.IQ2_XXS, 256)
    with pytest.raises(UnsupportedType, match="unknown GGML type 999"):
        row_bytes(999, 256)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes(T.Q4_K, 300)
    with pytest.raises(ValueError, match="needs 40 bytes"):
        PackedWeight.from_bytes(T.Q4_1, (2, 32), np.zeros(39, dtype=np.uint8))


def test_a_wrong_input_width_is_refused(native) -> None:  # noqa: ANN001
    weight = random_packed(T.Q8_0, 4, 64, np.random.default_rng())
    with pytest.raises(ValueError, match="does not fit"):
        native.packed_linear(torch.randn(2, 32), weight)
    with pytest.raises(IndexError, match="out of range"):
        native.dequantize_rows(weight, torch.tensor([4]))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_batch(native, qtype: T) -> None:  # noqa: ANN001
    """Decode steps of one or two rows dequantize in registers, larger ones through a strip in
    cache: every row must get the same bits either way (the engine's outputs may not depend
    on which requests shared a step)."""
    rng = np.random.default_rng()
    cols = cols_for(qtype)[-1]
    weight = random_packed(qtype, 61, cols, rng)
    x = torch.from_numpy(rng.standard_normal((9, cols)).astype(np.float32))
    alone = torch.cat([native.packed_linear(x[i:i + 1], weight) for i in range(9)])
    for rows in (2, 3, 5, 9):
        together = torch.cat([native.packed_linear(x[i:i + rows], weight)
                              for i in range(0, 9, rows)])
        assert torch.equal(together, alone), rows
