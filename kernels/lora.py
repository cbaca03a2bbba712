"""Batched LoRA, each row its own adapter: the plain-torch reference.

A projection's adapters are stacked: ``a`` [L, R, K] (PEFT's ``lora_A``, the shrink), ``b``
[L, N, R] (``lora_B``, the expand) and ``scale`` [L] (``alpha / r``, or ``alpha / sqrt(r)``
for rsLoRA). An adapter of rank r < R fills the first r rows of its ``a`` and columns of its
``b``; the rest stay zero, so one stack serves every rank up to R. Each row of a step names its
adapter in ``index`` [T] (``NO_ADAPTER`` for the base model alone) and gets
``y += scale * (x @ a.T) @ b.T`` from its own adapter: rows of different adapters share one
call. The Triton version is ``kernels.lora_triton``; ``kernels.ops.add_lora`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_ADAPTER = -1
MAX_RANK = 64


@dataclass(frozen=True, slots=True)
class LoraStack:
    """One projection's adapters, stacked (see the module docstring)."""

    a: torch.Tensor  # [L, R, K]
    b: torch.Tensor  # [L, N, R]
    scale: torch.Tensor  # [L] float32

    def __post_init__(self) -> None:
        n_a, rank, _ = self.a.shape
        n_b, _, rank_b = self.b.shape
        if not (n_a == n_b == self.scale.shape[0]) or rank != rank_b:
            raise ValueError(f"a {tuple(self.a.shape)}, b {tuple(self.b.shape)} and scale "
                             f"{tuple(self.scale.shape)} do not stack")
        if rank > MAX_RANK:
            raise ValueError(f"rank {rank} is above the largest supported, {MAX_RANK}")

    @property
    def num_adapters(self) -> int:
        return self.a.shape[0]


def check_lora(y: torch.Tensor, x: torch.Tensor, stack: LoraStack, index: torch.Tensor) -> None:
    tokens, k = x.shape
    if y.shape != (tokens, stack.b.shape[1]) or stack.a.shape[2] != k:
        raise ValueError(f"y {tuple(y.shape)}, x {tuple(x.shape)} do not fit the stack "
                         f"(a {tuple(stack.a.shape)}, b {tuple(stack.b.shape)})")
    if index.shape != (tokens,):
        raise ValueError(f"index {tuple(index.shape)} must be [{tokens}]")


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, stack: LoraStack,
                 index: torch.Tensor) -> None:
    """In place: ``y[t] += scale[i] * (x[t] @ a[i].T) @ b[i].T`` with i = index[t], for every
    row with an adapter; computed in float32, added once. y [T, N], x [T, K], index [T]."""
    check_lora(y, x, stack, index)
    for adapter in index.unique().tolist():
        if adapter == NO_ADAPTER:
            continue
        rows = (index == adapter).nonzero().squeeze(1)
        h = x[rows].float() @ stack.a[adapter].float().T  # [rows, R]
        delta = (h @ stack.b[adapter].float().T) * stack.scale[adapter]
        y[rows] = (y[rows].float() + delta).to(y.dtype)
