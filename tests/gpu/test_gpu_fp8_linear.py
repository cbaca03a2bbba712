"""The FP8 projections in bfloat16 on a real GPU, at Llama-3-8B's shapes.

Per-token activation quantization against its torch reference; the W8A8 GEMMs (Triton's and
cuBLAS's, e4m3 x e4m3 on the tensor cores) at decode-batch and prefill sizes against the float32
product of the same quantized operands; the one-row weight stream over e4m3 weights with the fused norm, SiLU and
residual add against the float32 reference on the dequantized weights; the whole W8A8 path
against the unquantized float32 product within FP8's own error; and one call captured in a CUDA
graph and replayed on new inputs, bit for bit against the same call run eagerly.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tidegate.kernels import ops
from tidegate.kernels.cpu.linear import linear_ref, norm_linear_ref
from tidegate.kernels.gpu.fp8_linear_triton import (
    fp8_gemm,
    fp8_linear_triton,
    quantize_rows_fp8,
    quantize_rows_ref,
    w8a8_linear_ref,
)
from tidegate.kernels.weights.fp8_weight import Fp8Weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, QKV, INTER = 4096, 6144, 14336
BF = torch.bfloat16
# e4m3 keeps 3 mantissa bits: a product of two e4m3-rounded operands over K = 4096 lands a few
# percent from the float32 product of the unrounded ones.
FP8_REL_ERR = 6e-2


def weight(n: int, k: int) -> Fp8Weight:
    return Fp8Weight.quantize(torch.randn(n, k, device="cuda") / k**0.5)


def test_rows_quantize_like_the_reference() -> None:
    x = torch.randn(4096, H, device="cuda", dtype=BF) * torch.logspace(
        -3, 3, 4096, device="cuda")[:, None].to(BF)
    q, s = quantize_rows_fp8(x)
    want_q, want_s = quantize_rows_ref(x)
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    assert (q.float() != want_q.float()).float().mean() < 1e-4  # ties after the division


@pytest.mark.parametrize("m", [3, 64, 1000, 4096])
@pytest.mark.parametrize(("n", "k", "silu"), [(QKV, H, False), (2 * INTER, H, True),
                                               (H, INTER, False)])
def test_w8a8_gemm_matches_the_quantized_operands(m: int, n: int, k: int, silu: bool) -> None:
    x = torch.randn(m, k, device="cuda", dtype=BF)
    w = weight(n, k)
    add = None if silu else torch.randn(m, n, device="cuda", dtype=BF)
    out = fp8_linear_triton(x, w, silu=silu, add=add)
    want = w8a8_linear_ref(x.float(), w, None if add is None else add.float(), silu=silu)
    assert out.dtype == BF and out.shape == want.shape and out.is_contiguous()
    assert rel_err(out, want) < BF16_REL_ERR
    # And against the unquantized operands: FP8's own error, no more.
    exact = linear_ref(x.float(), w.dequantize())
    if not silu:
        assert rel_err(fp8_linear_triton(x, w), exact) < FP8_REL_ERR
        # cuBLAS's FP8 GEMM (what many-row steps run) on the same quantized operands.
        plain = w8a8_linear_ref(x.float(), w)
        assert rel_err(fp8_gemm(x, w), plain) < BF16_REL_ERR


@pytest.mark.parametrize("m", [1, 2])
def test_one_row_stream_with_norm_silu_and_add(m: int) -> None:
    x = torch.randn(m, H, device="cuda", dtype=BF)
    norm = (1 + 0.1 * torch.randn(H, device="cuda")).to(BF)
    qkv, gate_up, down = weight(QKV, H), weight(2 * INTER, H), weight(H, INTER)
    out = ops.norm_linear(x, norm, 1e-5, qkv) if m == 1 else ops.linear(x, qkv)
    want = (norm_linear_ref(x.float(), norm.float(), 1e-5, qkv.dequantize()) if m == 1
            else linear_ref(x.float(), qkv.dequantize()))
    assert out.dtype == BF and rel_err(out, want) < BF16_REL_ERR
    if m == 1:
        out = ops.norm_linear(x, norm, 1e-5, gate_up, silu=True)
        want = norm_linear_ref(x.float(), norm.float(), 1e-5, gate_up.dequantize(), silu=True)
        assert out.shape == (1, INTER) and rel_err(out, want) < BF16_REL_ERR
    h = torch.randn(m, INTER, device="cuda", dtype=BF)
    out = ops.linear(h, down, add=x)
    assert rel_err(out, linear_ref(h.float(), down.dequantize(), x.float())) < BF16_REL_ERR


@pytest.mark.parametrize("m", [1, 256])
def test_graph_replay_equals_eager(m: int) -> None:
    w = weight(2 * INTER, H)
    x = torch.randn(m, H, device="cuda", dtype=BF)
    norm = (1 + 0.1 * torch.randn(H, device="cuda")).to(BF)

    def call() -> torch.Tensor:
        if m == 1:
            return ops.norm_linear(x, norm, 1e-5, w, silu=True)
        return ops.linear(x, w)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, call())
