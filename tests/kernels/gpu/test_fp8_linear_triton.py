"""The FP8 Triton projections (``tidegate.kernels.gpu.fp8_linear_triton``) against their plain-torch
references: per-token activation quantization, the W8A8 GEMM (partial row, column and K tiles,
the SiLU-and-mul epilogue, the residual add), the few-row weight stream over e4m3 weights (with
the RMSNorm prologue), and the wrappers' refusals.

Without CUDA they run in Triton's interpreter (small shapes, float32 and float16; bfloat16 and
the model's shapes are in ``tests/gpu/test_gpu_fp8_linear.py``).
"""

from __future__ import annotations

import pytest
import torch

from tidegate.kernels.cpu.linear import linear_ref, norm_linear_ref
from tidegate.kernels.gpu.fp8_linear_triton import (
    Fp8GemmConfig,
    fp8_linear_triton,
    quantize_rows_fp8,
    quantize_rows_ref,
    w8a8_linear_ref,
)
from tidegate.kernels.gpu.linear_triton import SkinnyConfig, skinny_linear_triton
from tidegate.kernels.weights.fp8_weight import FP8_MAX, Fp8Weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
K = 192
N = 40  # no multiple of any block
SMALL = Fp8GemmConfig(block_m=32, block_n=16, block_k=64, num_warps=4, num_stages=1)


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def fp8_weight(n: int, k: int) -> Fp8Weight:
    return Fp8Weight.quantize(torch.randn(n, k) / k**0.5).to(DEVICE)


def activations(m: int, k: int, dtype: torch.dtype, spread: float = 2.0) -> torch.Tensor:
    # A strided view (a padded row stride), as a slice of a larger activation would be; rows
    # of very different magnitudes (10**-spread .. 10**spread), so per-token scales matter.
    x = (torch.randn(m, k + 8, device=DEVICE)
         * torch.logspace(-spread, spread, m, device=DEVICE)[:, None])
    return x.to(dtype)[:, :k]


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # The same e4m3 operands on both sides: float32 sums in another order, rounded to dtype.
    # Hopper's FP8 tensor cores keep fewer bits in their sums than float32 (a few 1e-3).
    tol = ({"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 and DEVICE == "cpu"
           else {"rtol": 1e-2 if DEVICE == "cuda" else 3e-3, "atol": 3e-3})
    assert out.dtype == want.dtype and out.shape == want.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_quantize_to_e4m3_with_their_own_scale(dtype: torch.dtype) -> None:
    x = activations(37, 300, dtype)  # 300: a partial last step of the kernel's row loop
    x[3] = 0  # a row of zeros keeps a positive scale and zero values
    q, scales = quantize_rows_fp8(x)
    want_q, want_scales = quantize_rows_ref(x)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    # Every row's largest magnitude is 448; the values are e4m3's nearest (a tie may round
    # either way after the scale's division: at most one step apart, and very rarely).
    assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(37) != 3],
                       torch.full((36,), FP8_MAX, device=DEVICE))
    steps = (q.float() - want_q.float()).abs() / want_q.float().abs().clamp(min=2**-6)
    assert (steps <= 0.125).all() and (q.float() != want_q.float()).float().mean() < 1e-3
    assert scales[3] > 0 and not q[3].float().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_matches_the_quantized_operands_product(dtype: torch.dtype) -> None:
    # 1 row, a partial row tile (37), several row tiles (70); K a multiple of the step and
    # not (K = 160 in steps of 64).
    for m, k in ((1, K), (37, K), (70, 160)):
        w = fp8_weight(N, k)
        x = activations(m, k, dtype)
        add = torch.randn(m, N, device=DEVICE, dtype=dtype)
        assert_close(fp8_linear_triton(x, w, config=SMALL), w8a8_linear_ref(x, w), dtype)
        assert_close(fp8_linear_triton(x, w, add=add, config=SMALL),
                     w8a8_linear_ref(x, w, add), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_silu_epilogue_pairs_gate_and_up_rows(dtype: torch.dtype) -> None:
    inter = 21  # odd, and no multiple of a block: gate rows 0-20, up rows 21-41
    w = fp8_weight(2 * inter, K)
    x = activations(33, K, dtype, spread=0.5)  # gates whose exp stays finite
    out = fp8_linear_triton(x, w, silu=True, config=SMALL)
    assert out.shape == (33, inter)
    assert_close(out, w8a8_linear_ref(x, w, silu=True), dtype)


def test_default_tiles_serve_any_rows() -> None:
    w = fp8_weight(N, K)
    for m in (2, 65, 130):
        x = activations(m, K, torch.float32, spread=0.5)
        assert_close(fp8_linear_triton(x, w), w8a8_linear_ref(x, w), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_few_rows_stream_e4m3_weights_with_their_row_scales(dtype: torch.dtype) -> None:
    """Weight-only: activations in their own dtype, the scale multiplying the finished sums."""
    w = fp8_weight(2 * N, K)
    deq = w.dequantize()  # float32: the kernel scales float32 sums, not rounded weights
    norm = (1 + 0.1 * torch.randn(K, device=DEVICE)).to(dtype)
    for m, cfg in ((1, None), (2, SkinnyConfig(block_n=4, block_k=64)),
                   (1, SkinnyConfig(block_n=2, block_k=256, persistent=2))):
        x = activations(m, K, dtype, spread=0.5)
        add = torch.randn(m, 2 * N, device=DEVICE, dtype=dtype)
        out = skinny_linear_triton(x, w.weight, weight_scale=w.scales, add=add, config=cfg)
        assert out.dtype == dtype
        assert_close(out, linear_ref(x.float(), deq, add.float()).to(dtype), dtype)
        out = skinny_linear_triton(x, w.weight, weight_scale=w.scales, norm_weight=norm,
                                   eps=1e-5, silu=True, config=cfg)
        want = norm_linear_ref(x.float(), norm.float(), 1e-5, deq, silu=True)
        assert_close(out, want.to(dtype), dtype)


def test_refusals_name_the_operand() -> None:
    w = fp8_weight(N, K)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_linear_triton(torch.randn(2, K + 1, device=DEVICE), w)
    with pytest.raises(ValueError, match="odd"):
        fp8_linear_triton(torch.randn(2, K, device=DEVICE), fp8_weight(5, K), silu=True)
    with pytest.raises(ValueError, match="add must be"):
        fp8_linear_triton(torch.randn(2, K, device=DEVICE), w,
                          add=torch.randn(3, N, device=DEVICE))
    with pytest.raises(ValueError, match="Fp8Weight"):
        fp8_linear_triton(torch.randn(2, K, device=DEVICE), torch.randn(N, K))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_scale"):
        skinny_linear_triton(torch.randn(1, K, device=DEVICE), w.weight)
    with pytest.raises(ValueError, match="power of two"):
        Fp8GemmConfig(block_m=48)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_silu_kernels_round_their_rows_to_e4m3(dtype: torch.dtype) -> None:
    """The RMSNorm (with its residual add) and SiLU-and-mul kernels that feed W8A8 GEMMs: their
    e4m3 rows and scales are ``quantize_rows_fp8`` of what the plain kernels write."""
    from tidegate.kernels.gpu.activation_triton import silu_and_mul_fp8, silu_and_mul_triton
    from tidegate.kernels.gpu.rmsnorm_triton import rms_norm_fp8, rms_norm_triton

    x = activations(9, 200, dtype, spread=0.5)  # 200: a masked tail in the row's block
    res = torch.randn(9, 200, device=DEVICE, dtype=dtype)
    norm = (1 + 0.1 * torch.randn(200, device=DEVICE)).to(dtype)
    rows, new_res = rms_norm_fp8(x, norm, 1e-5, res)
    normed, want_res = rms_norm_triton(x, norm, 1e-5, res)
    assert torch.equal(new_res, want_res) and rows.dtype == dtype
    want_q, want_s = quantize_rows_fp8(normed)
    torch.testing.assert_close(rows.scales, want_s, rtol=1e-6, atol=0)
    assert torch.equal(rows.q.float(), want_q.float())
    gate_up = activations(9, 2 * 100, dtype, spread=0.5)
    rows = silu_and_mul_fp8(gate_up)
    want_q, want_s = quantize_rows_fp8(silu_and_mul_triton(gate_up))
    torch.testing.assert_close(rows.scales, want_s, rtol=1e-6, atol=0)
    assert torch.equal(rows.q.float(), want_q.float())


def test_many_row_steps_take_the_fused_w8a8_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.norm_project / silu_project with e4m3 weights: the norm or SiLU kernel's e4m3 rows
    into the GEMM, equal to quantizing the plain kernels' output; a row or two stream the
    weights instead (activations unrounded)."""
    from tidegate.kernels import ops

    monkeypatch.setenv("TIDEGATE_KERNELS", "triton")
    w_qkv, w_down = fp8_weight(N, K), fp8_weight(N, N)
    hidden = activations(6, K, torch.float32, spread=0.5)
    res = torch.randn(6, K, device=DEVICE)
    norm = 1 + 0.1 * torch.randn(K, device=DEVICE)
    out, new_res = ops.norm_project(hidden, norm, 1e-5, res, w_qkv)
    normed, want_res = ops.rms_norm(hidden, norm, 1e-5, res)
    assert torch.equal(new_res, want_res)
    assert_close(out, w8a8_linear_ref(normed, w_qkv), torch.float32)
    gate_up = activations(6, 2 * N, torch.float32, spread=0.5)
    assert_close(ops.silu_project(gate_up, w_down),
                 w8a8_linear_ref(ops.silu_and_mul(gate_up), w_down), torch.float32)
    one = ops.silu_project(gate_up[:1], w_down)  # one row: the weight stream
    assert_close(one, linear_ref(ops.silu_and_mul(gate_up[:1]), w_down.dequantize()),
                 torch.float32)
