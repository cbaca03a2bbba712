"""Batched LoRA on a real GPU, in bf16 at Llama-3-8B's projection shapes: the Triton kernels
against the float32 reference for a decode batch mixing eight rank-16 adapters and the base
model, for a prefill-sized batch and for one row, on the packed qkv and gate_up projections
(segments, RMSNorm fused on the input) and on o and down; and a decode step's rows and LoRA
captured in a CUDA graph and replayed on new rows, with no read back to the host. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import BF16_REL_ERR, rel_err
from tidegate.kernels.gpu.lora_triton import add_lora_triton
from tidegate.kernels.ops import lora_rows
from tidegate.kernels.reference.lora import NO_ADAPTER, LoraStack, Norm, add_lora_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
# name -> (K, N, segments, normed): the decoder's fused paths norm the input of qkv and gate_up.
PROJECTIONS = {"qkv": (HIDDEN, Q + 2 * KV, (Q, Q + KV), True),
               "gate_up": (HIDDEN, 2 * INTER, (INTER,), True),
               "o": (Q, HIDDEN, (), False), "down": (INTER, HIDDEN, (), False)}


def stack(adapters: int, rank: int, k: int, n: int, segments: tuple[int, ...]) -> LoraStack:
    count = len(segments) + 1
    a = torch.randn(adapters, count * rank, k, device="cuda") / k ** 0.5
    b = torch.randn(adapters, n, rank, device="cuda") / rank ** 0.5
    return LoraStack(a.bfloat16(), b.bfloat16(), torch.full((adapters,), 2.0, device="cuda"),
                     segments)


def as_float(lora: LoraStack) -> LoraStack:
    return LoraStack(lora.a.float(), lora.b.float(), lora.scale, lora.segments)


def norm_of(k: int) -> Norm:
    return (1 + 0.2 * torch.randn(k, device="cuda")).bfloat16(), 1e-5


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("tokens", [1, 256, 3000])
def test_triton_equals_the_reference_in_bf16(projection: str, tokens: int) -> None:
    k, n, segments, normed = PROJECTIONS[projection]
    lora = stack(8, 16, k, n, segments)
    x = (3 * torch.randn(tokens, k, device="cuda")).bfloat16()
    index = torch.randint(NO_ADAPTER, 8, (tokens,), device="cuda")
    if tokens == 1:
        index[0] = 3
    norm = norm_of(k) if normed else None
    y0 = torch.randn(tokens, n, device="cuda").bfloat16()
    rows = lora_rows(index, 8)
    got = y0.clone()
    add_lora_triton(got, x, lora, rows, norm)
    want = y0.float().clone()
    add_lora_ref(want, x.float(), as_float(lora), rows,
                 None if norm is None else (norm[0].float(), norm[1]))
    assert rel_err(got - y0, want - y0.float()) < BF16_REL_ERR
    none = index == NO_ADAPTER
    assert torch.equal(got[none], y0[none])


@pytest.mark.parametrize("tokens", [4, 40])  # a tile a row, and rows sorted by adapter
def test_a_step_is_captured_in_a_cuda_graph(tokens: int) -> None:
    """lora_rows once, then every projection's LoRA, replayed on new rows and adapters:
    nothing may read back to the host (the sync check raises where anything does)."""
    stacks = {name: stack(8, 16, k, n, segments)
              for name, (k, n, segments, _) in PROJECTIONS.items()}
    norms = {name: norm_of(k) for name, (k, _, _, normed) in PROJECTIONS.items() if normed}
    index = torch.zeros(tokens, dtype=torch.long, device="cuda")
    xs = {name: torch.zeros(tokens, k, device="cuda").bfloat16()
          for name, (k, _, _, _) in PROJECTIONS.items()}
    ys = {name: torch.zeros(tokens, n, device="cuda").bfloat16()
          for name, (_, n, _, _) in PROJECTIONS.items()}

    def step() -> None:
        rows = lora_rows(index, 8)
        for name, lora in stacks.items():
            add_lora_triton(ys[name], xs[name], lora, rows, norms.get(name))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    index.copy_(torch.tensor([5, NO_ADAPTER, 0, 5] * (tokens // 4), device="cuda"))
    for x in xs.values():
        x.copy_(3 * torch.randn_like(x))
    starts = {name: torch.randn_like(y) for name, y in ys.items()}
    for name, y in ys.items():
        y.copy_(starts[name])
    graph.replay()
    torch.cuda.synchronize()
    rows = lora_rows(index, 8)
    for name, lora in stacks.items():
        want = starts[name].float()
        norm = norms.get(name)
        add_lora_ref(want, xs[name].float(), as_float(lora), rows,
                     None if norm is None else (norm[0].float(), norm[1]))
        assert rel_err(ys[name] - starts[name], want - starts[name].float()) < BF16_REL_ERR
        assert torch.equal(ys[name][1], starts[name][1])
