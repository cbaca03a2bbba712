"""Batched LoRA (``kernels.lora``): the reference against the row-by-row definition and against
weights merged the way PEFT merges them, and the Triton kernels against the reference: rows of
several adapters, of ranks below the stack's, and of none, in one call. Without CUDA the Triton
kernels run in the interpreter (``tests/conftest.py`` sets TRITON_INTERPRET), in float32 and
float16."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.lora import NO_ADAPTER, LoraStack, add_lora_ref
from kernels.lora_triton import add_lora_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stack_of(ranks: list[int], k: int, n: int, max_rank: int, seed: int = 0,
             dtype: torch.dtype = torch.float32) -> LoraStack:
    """Adapters of the given ranks, zero-padded to ``max_rank``; scale alpha / r, alpha = 2r."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(ranks), max_rank, k)
    b = torch.zeros(len(ranks), n, max_rank)
    for i, r in enumerate(ranks):
        a[i, :r] = torch.randn(r, k, generator=g) / k ** 0.5
        b[i, :, :r] = torch.randn(n, r, generator=g) / r ** 0.5
    scale = torch.tensor([2.0] * len(ranks))
    return LoraStack(a.to(DEVICE, dtype), b.to(DEVICE, dtype), scale.to(DEVICE))


def test_reference_equals_the_definition_and_merged_weights() -> None:
    k, n = 24, 40
    stack = stack_of([4, 8, 2], k, n, max_rank=8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, k, generator=g).to(DEVICE)
    base = torch.randn(n, k, generator=g).to(DEVICE)
    index = torch.tensor([0, 2, NO_ADAPTER, 1, 1, 0, NO_ADAPTER, 2, 0, 1, 2], device=DEVICE)
    y = x @ base.T
    add_lora_ref(y, x, stack, index)
    for t in range(x.shape[0]):
        i = int(index[t])
        want = x[t] @ base.T
        if i != NO_ADAPTER:
            # PEFT's merge: W + scale * B @ A.
            merged = base + stack.scale[i] * stack.b[i] @ stack.a[i]
            want = x[t] @ merged.T
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_equals_the_reference(tokens: int, dtype: torch.dtype) -> None:
    k, n = 64, 96  # n not a multiple of the 64-column tiles
    stack = stack_of([16, 8, 4], k, n, max_rank=16, dtype=dtype)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    index = torch.randint(-1, 3, (tokens,), generator=g).to(DEVICE)
    y0 = torch.randn(tokens, n, generator=g).to(DEVICE, dtype)
    want, got = y0.clone(), y0.clone()
    add_lora_ref(want, x, stack, index)
    add_lora_triton(got, x, stack, index)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    untouched = index == NO_ADAPTER
    assert torch.equal(got[untouched], y0[untouched])


def test_a_batch_of_one_adapter_equals_each_row_alone() -> None:
    k, n = 64, 64
    stack = stack_of([8, 8], k, n, max_rank=8)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    index = torch.tensor([1] * 20, device=DEVICE)
    together = torch.zeros(20, n, device=DEVICE)
    add_lora_triton(together, x, stack, index)
    for t in range(20):
        alone = torch.zeros(1, n, device=DEVICE)
        add_lora_triton(alone, x[t:t + 1], stack, index[t:t + 1])
        torch.testing.assert_close(together[t:t + 1], alone, rtol=1e-5, atol=1e-5)


def test_ops_serves_the_reference_off_cuda_and_checks_shapes() -> None:
    stack = stack_of([4], 8, 8, max_rank=4)
    x = torch.randn(3, 8).to(DEVICE)
    y = torch.zeros(3, 8, device=DEVICE)
    ops.add_lora(y, x, stack, torch.tensor([0, -1, 0], device=DEVICE))
    assert torch.count_nonzero(y[1]) == 0 and torch.count_nonzero(y[0]) > 0
    with pytest.raises(ValueError, match="do not fit"):
        ops.add_lora(torch.zeros(3, 9, device=DEVICE), x, stack,
                     torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="rank 65"):
        LoraStack(torch.zeros(1, 65, 8), torch.zeros(1, 8, 65), torch.ones(1))
