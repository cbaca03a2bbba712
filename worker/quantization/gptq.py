"""GPTQ (Frantar et al., 2022): weight rounding that compensates each column's error in the
columns not yet rounded, using the layer's input statistics.

For a projection y = x W^T with inputs X (calibration tokens), the Hessian of the output error
is H = 2 X^T X / n. Columns are rounded one at a time (in blocks of ``block`` columns, with lazy
updates of the rest); after rounding column i the remaining columns absorb its error,
weighted by the inverse Hessian's Cholesky factor, so the layer's output on X moves as little
as the rounding allows. Scales and zero points of a group are fixed when the group's first
column is reached, from the columns as updated so far. ``act_order`` rounds the columns with
the largest H diagonal (the most active inputs) first: the result's columns are then in that
order, which ``IntWeight.perm`` records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidegate.kernels.weights.int_weight import IntWeight, rtn


@dataclass
class HessianStats:
    """Sum of x x^T over the calibration tokens a projection saw."""

    columns: int
    hessian: torch.Tensor | None = None
    tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.columns).double()
        if self.hessian is None:
            self.hessian = torch.zeros(self.columns, self.columns, dtype=torch.float64)
        self.hessian += x.t() @ x
        self.tokens += x.shape[0]

    def matrix(self) -> torch.Tensor:
        """2 X^T X / n in float64 ([K, K])."""
        if self.hessian is None or self.tokens == 0:
            raise ValueError("no calibration tokens reached this projection")
        return 2.0 * self.hessian / self.tokens


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int,
                  group_size: int | None, symmetric: bool = True, act_order: bool = False,
                  damp: float = 0.01, block: int = 128) -> IntWeight:
    """GPTQ of a float [N, K] matrix given its inputs' Hessian [K, K] -> ``IntWeight``.

    ``damp``: fraction of the mean Hessian diagonal added to it (keeps the Cholesky
    factorization positive definite); ``block`` columns are updated lazily together."""
    n, k = weight.shape
    g = k if group_size in (None, -1) else int(group_size)
    if k % g:
        raise ValueError(f"group size {g} does not divide {k} columns")
    w = weight.detach().double().clone()
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=torch.float64)
    # The upper Cholesky factor of H^-1: row i holds the weights with which column i's error
    # spreads over columns i.. (the OBS update, column by column).
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    top = (1 << bits) - 1
    q = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.zeros(n, k // g, dtype=torch.float64)
    zeros = torch.zeros(n, k // g, dtype=torch.int32)
    block = max(g, block // g * g) if g < k else block
    if g == k:  # one group per row: its parameters come from the whole (unupdated) row
        _, s0, z0 = rtn(w, bits, None, symmetric)
        scales[:, 0], zeros[:, 0] = s0[:, 0].double(), z0[:, 0]
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if g < k and col % g == 0:  # a group starts: its columns as updated so far
                _, s, z = rtn(w1[:, i:i + g], bits, None, symmetric)
                scales[:, col // g], zeros[:, col // g] = s[:, 0].double(), z[:, 0]
            s = scales[:, col // g]
            z = zeros[:, col // g].double()
            qi = torch.clamp(torch.round(w1[:, i] / s) + z, 0, top)
            q[:, col] = qi.to(torch.int32)
            e = (w1[:, i] - (qi - z) * s) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    return IntWeight.from_ints(q, scales.float(), zeros, bits, perm=perm, format="gptq")
