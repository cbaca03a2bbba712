"""The few-row Triton projection in bfloat16 on a real GPU, at Llama-3-8B's projection shapes.

Each fused form (plain, residual add, RMSNorm prologue, SiLU epilogue) against the float32
reference on the same bfloat16 inputs, by relative error; then a chain of them launched with
programmatic dependent launch (each kernel starts while the one before drains and waits for it
before reading its input) captured in a CUDA graph and replayed on new inputs, against the same
chain run eagerly without PDL: the dependency must hold bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tidegate.kernels.cpu.linear import linear_ref, norm_linear_ref
from tidegate.kernels.gpu.linear_triton import pdl_supported, skinny_linear_triton

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, QKV, INTER, V = 4096, 6144, 14336, 128256
BF = torch.bfloat16


def weight(n: int, k: int) -> torch.Tensor:
    return (torch.randn(n, k, device="cuda") / k**0.5).to(BF)


@pytest.mark.parametrize("m", [1, 2, 4, 16])
@pytest.mark.parametrize(("n", "k"), [(QKV, H), (H, H), (H, INTER), (V, H)])
def test_plain_and_add_bf16(m: int, n: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=BF)
    w = weight(n, k)
    add = torch.randn(m, n, device="cuda", dtype=BF)
    assert rel_err(skinny_linear_triton(x, w), linear_ref(x.float(), w.float())) < BF16_REL_ERR
    out = skinny_linear_triton(x, w, add=add)
    assert rel_err(out, linear_ref(x.float(), w.float(), add.float())) < BF16_REL_ERR


@pytest.mark.parametrize("m", [1, 2, 4, 16])
@pytest.mark.parametrize(("n", "silu"), [(QKV, False), (2 * INTER, True)])
def test_norm_and_silu_bf16(m: int, n: int, silu: bool) -> None:
    x = torch.randn(m, H, device="cuda", dtype=BF)
    norm = (1 + 0.1 * torch.randn(H, device="cuda")).to(BF)
    w = weight(n, H)
    out = skinny_linear_triton(x, w, norm_weight=norm, eps=1e-5, silu=silu)
    want = norm_linear_ref(x.float(), norm.float(), 1e-5, w.float(), silu)
    assert out.shape == want.shape and out.dtype == BF
    assert rel_err(out, want) < BF16_REL_ERR


@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_supported(torch.device("cuda")),
                    reason="programmatic dependent launch needs sm_90+")
def test_pdl_chain_in_a_cuda_graph_matches_eager() -> None:
    """Two layers' projections, each consuming the one before: a kernel that read its input
    before the previous one finished would differ."""
    layers = [(weight(QKV, H), weight(H, H), weight(2 * INTER, H), weight(H, INTER))
              for _ in range(2)]
    norm = torch.ones(H, device="cuda", dtype=BF)
    h_in = torch.randn(1, H, device="cuda", dtype=BF)

    def step(pdl: bool) -> torch.Tensor:
        h = h_in
        for qkv_w, o_w, gu_w, down_w in layers:
            qkv = skinny_linear_triton(h, qkv_w, norm_weight=norm, pdl=pdl)
            h = skinny_linear_triton(qkv[:, :H], o_w, add=h, pdl=pdl)
            act = skinny_linear_triton(h, gu_w, norm_weight=norm, silu=True, pdl=pdl)
            h = skinny_linear_triton(act, down_w, add=h, pdl=pdl)
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    for _ in range(3):
        h_in.copy_(torch.randn(1, H, device="cuda", dtype=BF))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step(False))
