"""AWQ (Lin et al., 2023): activation-aware scaling of input channels before rounding.

A few input channels carry most of a layer's activation magnitude; their weights matter most.
AWQ multiplies those columns of the weight by s > 1 before rounding (and divides the layer's
input by s, folded into the operation that produces it: the RMSNorm weight before q/k/v and
gate/up, the up projection's rows before down), so their rounding error shrinks relative to
the signal while the float function is unchanged. The per-channel scale is
``s = mean|x|^alpha``, normalized, with alpha searched on a grid for the smallest output error
of the rounded layer on calibration inputs.
"""

from __future__ import annotations

import torch

from tidegate.kernels.weights.int_weight import IntWeight

GRID = 20  # alpha in 0, 1/20, ..., 19/20


def awq_scales(weights: list[torch.Tensor], x: torch.Tensor, bits: int, group_size: int | None,
               symmetric: bool, grid: int = GRID) -> torch.Tensor:
    """The input-channel scales [K] for the matrices ``weights`` (each [N_i, K]) that read the
    same inputs ``x`` [T, K]: the alpha of ``mean|x|^alpha`` whose rounded matrices reproduce
    ``x @ W.T`` best (summed squared error over all of them)."""
    x = x.float()
    w = torch.cat([wi.float() for wi in weights])
    want = x @ w.t()
    magnitude = x.abs().mean(dim=0).clamp(min=1e-8)
    best, best_err = torch.ones_like(magnitude), float("inf")
    for step in range(grid):
        s = magnitude.pow(step / grid)
        s = s / (s.max() * s.min()).sqrt()
        rounded = IntWeight.quantize(w * s, bits, group_size, symmetric).dequantize() / s
        err = (x @ rounded.t() - want).pow(2).mean().item()
        if err < best_err:
            best, best_err = s, err
    return best
