"""The gated activations: SiLU-and-multiply (SwiGLU) and GELU(tanh)-and-multiply (GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holding gate then up -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holding gate then up -> gelu_tanh(gate) * up, [T, I] (Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
