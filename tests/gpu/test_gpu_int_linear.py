"""The integer-weight Triton projection in bfloat16 on a real GPU, at Llama-3-8B's shapes.

INT4 with groups of 128 and INT8 per channel, at decode (1 and 4 rows: the FMA and tensor-core
paths) and prefill (512 rows) sizes, each fused form (qkv with its norm, gate_up with norm and
SiLU, down_proj with the residual add) against the float32 reference on the dequantized weights,
by relative error; then one call captured in a CUDA graph and replayed on new inputs, against
the same call run eagerly: bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tidegate.kernels.cpu.linear import linear_ref, norm_linear_ref
from tidegate.kernels.gpu.int_linear_triton import int_linear_triton
from tidegate.kernels.weights.int_weight import IntWeight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, QKV, INTER = 4096, 6144, 14336
BF = torch.bfloat16
FORMATS = [(4, 128), (8, None)]  # (bits, group size; None: one group per row)


def weight(n: int, k: int, bits: int, group: int | None) -> IntWeight:
    w = torch.randn(n, k, device="cuda") / k**0.5
    return IntWeight.quantize(w, bits, group, symmetric=bits == 8)


@pytest.mark.parametrize("m", [1, 4, 512])
@pytest.mark.parametrize(("bits", "group"), FORMATS)
def test_qkv_with_norm_bf16(m: int, bits: int, group: int | None) -> None:
    x = torch.randn(m, H, device="cuda", dtype=BF)
    norm = (1 + 0.1 * torch.randn(H, device="cuda")).to(BF)
    w = weight(QKV, H, bits, group)
    out = int_linear_triton(x, w, norm_weight=norm, eps=1e-5)
    want = norm_linear_ref(x.float(), norm.float(), 1e-5, w.dequantize())
    assert out.shape == (m, QKV) and out.dtype == BF and out.is_contiguous()
    assert rel_err(out, want) < BF16_REL_ERR


@pytest.mark.parametrize("m", [1, 4, 512])
@pytest.mark.parametrize(("bits", "group"), FORMATS)
def test_gate_up_with_norm_and_silu_bf16(m: int, bits: int, group: int | None) -> None:
    x = torch.randn(m, H, device="cuda", dtype=BF)
    norm = (1 + 0.1 * torch.randn(H, device="cuda")).to(BF)
    w = weight(2 * INTER, H, bits, group)
    out = int_linear_triton(x, w, norm_weight=norm, eps=1e-5, silu=True)
    want = norm_linear_ref(x.float(), norm.float(), 1e-5, w.dequantize(), silu=True)
    assert out.shape == (m, INTER) and out.dtype == BF
    assert rel_err(out, want) < BF16_REL_ERR


@pytest.mark.parametrize("m", [1, 4, 512])
@pytest.mark.parametrize(("bits", "group"), FORMATS)
def test_down_proj_with_add_bf16(m: int, bits: int, group: int | None) -> None:
    x = torch.randn(m, INTER, device="cuda", dtype=BF)
    add = torch.randn(m, H, device="cuda", dtype=BF)
    w = weight(H, INTER, bits, group)
    out = int_linear_triton(x, w, add=add)
    want = linear_ref(x.float(), w.dequantize(), add.float())
    assert rel_err(out, want) < BF16_REL_ERR


@pytest.mark.parametrize("m", [1, 4])
def test_cuda_graph_replay_matches_eager(m: int) -> None:
    w = weight(QKV, H, 4, 128)
    norm = torch.ones(H, device="cuda", dtype=BF)
    x = torch.randn(m, H, device="cuda", dtype=BF)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int_linear_triton(x, w, norm_weight=norm)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int_linear_triton(x, w, norm_weight=norm)
    for _ in range(3):
        x.copy_(torch.randn(m, H, device="cuda", dtype=BF))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, int_linear_triton(x, w, norm_weight=norm))


@pytest.mark.parametrize("m", [1, 512])
def test_act_order_bf16(m: int) -> None:
    x = torch.randn(m, H, device="cuda", dtype=BF)
    q = weight(QKV, H, 4, 128)
    perm = torch.randperm(H, device="cuda")
    w = IntWeight(q.shape, q.bits, q.group_size, q.qweight, q.scales, q.zeros, perm)
    assert rel_err(int_linear_triton(x, w), linear_ref(x.float(), w.dequantize())) < BF16_REL_ERR
