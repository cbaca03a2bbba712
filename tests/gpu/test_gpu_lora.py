"""Batched LoRA on a real GPU, in bf16 at Llama-3-8B's projection shapes: the Triton kernels
against the float32 reference for a decode batch mixing eight rank-16 adapters and the base
model, for a prefill-sized batch and for one row. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import NO_ADAPTER, LoraStack, add_lora_ref
from kernels.lora_triton import add_lora_triton
from tests.gpu.conftest import BF16_REL_ERR, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def stack(adapters: int, rank: int, k: int, n: int) -> LoraStack:
    a = torch.randn(adapters, rank, k, device="cuda") / k ** 0.5
    b = torch.randn(adapters, n, rank, device="cuda") / rank ** 0.5
    return LoraStack(a.bfloat16(), b.bfloat16(), torch.full((adapters,), 2.0, device="cuda"))


@pytest.mark.parametrize(("tokens", "k", "n"), [(256, 4096, 4096), (256, 4096, 14336),
                                                (3000, 4096, 1024), (1, 4096, 4096)])
def test_triton_equals_the_reference_in_bf16(tokens: int, k: int, n: int) -> None:
    lora = stack(8, 16, k, n)
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    index = torch.randint(NO_ADAPTER, 8, (tokens,), device="cuda")
    y0 = torch.randn(tokens, n, device="cuda").bfloat16()
    got = y0.clone()
    add_lora_triton(got, x, lora, index)
    want = y0.float().clone()
    add_lora_ref(want, x.float(), LoraStack(lora.a.float(), lora.b.float(), lora.scale), index)
    assert rel_err(got - y0, want - y0.float()) < BF16_REL_ERR
    none = index == NO_ADAPTER
    assert torch.equal(got[none], y0[none])
