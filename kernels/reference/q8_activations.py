"""8-bit activations for the CPU's quantized projections: the modes, and the plain-torch
reference of how a row is rounded (``csrc/q8_linear_cpu.c`` computes it natively).

A quantized matrix on the CPU is multiplied either with float32 activations (``"float"``: the
dequantized matrix's product up to summation order, so a packed model gives the float32
model's outputs) or with activations rounded per row to 8-bit blocks (``"int8"``: integer dot
products, as llama.cpp pairs Q4_0/Q4_1/Q8_0/K-quant weights with Q8 activations; about 4x
fewer instructions per weight, and outputs that differ from the float model's by the
activations' rounding). The choice travels with the weights (``PackedWeight.activations``,
``IntWeight.activations``); the GPU's kernels ignore it.

Rounding, per row and per block of 32 columns (each row alone, so a row's result never depends
on the other rows of its batch): ``d = max|x| * (1/127)``, ``q = round_half_even(x * (1/d))``
in float32, ``x ~= d * q`` with ``q`` in -127..127.
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("float", "int8")
BLOCK = 32
# 1/127 rounded once to float32, as the C constant (1.0f / 127.0f) is.
_INV_127 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)


def check_activations(mode: str) -> str:
    """``mode`` if it names an activation mode; else a ValueError listing them."""
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {mode!r}")
    return mode


def quantize_rows_q8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of 32) -> (q [M, K] int8, d [M, K / 32] float32)."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"8-bit activations come in blocks of {BLOCK}; {k} columns are not")
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=2) * _INV_127
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(m, k), d


def dequantize_rows_q8_ref(x: torch.Tensor) -> torch.Tensor:
    """x as the 8-bit kernels see it: rounded to 8-bit blocks and back, [M, K] float64 (exact)."""
    q, d = quantize_rows_q8_ref(x)
    m, k = x.shape
    return (q.double().reshape(m, k // BLOCK, BLOCK) * d.double()[..., None]).reshape(m, k)
