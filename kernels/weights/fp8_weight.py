"""A weight matrix of FP8 (e4m3) values with one float32 scale per output row (``Fp8Weight``).

This is the one in-memory layout of FP8 checkpoints (compressed-tensors ``float-quantized``,
``tidegate quantize --method fp8``): a per-tensor scale is repeated on every row, so a fused
q/k/v or gate/up matrix of parts with different tensor scales is still one matrix. The value
at (n, k) is ``float(weight[n, k]) * scales[n]``. Nothing dequantizes a whole matrix except
``dequantize``, the reference the kernels are checked against.

* ``weight``: ``torch.float8_e4m3fn`` [N, K] (finite values up to +-448, no infinities);
* ``scales``: float32 [N].

Activations are quantized per token at run time where the kernel computes in FP8 (many rows on
a GPU with FP8 matrix units: W8A8), and stay in the model's dtype elsewhere (few rows, and the
CPU: weight-only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


@dataclass(frozen=True)
class Fp8Weight:
    """A [N, K] matrix of e4m3 values, scaled per row."""

    shape: tuple[int, int]
    weight: torch.Tensor
    scales: torch.Tensor
    format: str = "fp8"  # where the values came from (compressed-tensors, rtn)

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.weight.dtype != FP8_DTYPE or tuple(self.weight.shape) != (n, k):
            raise ValueError(f"weight must be {FP8_DTYPE} {[n, k]}, got {self.weight.dtype} "
                             f"{list(self.weight.shape)}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (n,):
            raise ValueError(f"scales must be torch.float32 [{n}], got {self.scales.dtype} "
                             f"{list(self.scales.shape)}")

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: str = "rtn") -> Fp8Weight:
        """Per-row round to nearest e4m3: scale max|w| / 448, so each row's largest magnitude
        lands on 448."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1) / FP8_MAX
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return cls(tuple(w.shape), q.contiguous(), scales.contiguous(), format)

    @classmethod
    def cat(cls, weights: list[Fp8Weight]) -> Fp8Weight:
        """Matrices stacked row-wise (q, k, v -> qkv)."""
        first = weights[0]
        if any(w.shape[1] != first.shape[1] for w in weights):
            raise ValueError("fused matrices differ in columns")
        if len(weights) == 1:
            return first
        return cls((sum(w.shape[0] for w in weights), first.shape[1]),
                   torch.cat([w.weight for w in weights]), torch.cat([w.scales for w in weights]),
                   first.format)

    @property
    def activations(self) -> str:
        """What the CPU multiplies it with: always float32 (its kernel has no 8-bit-activation
        form; ``tidegate.kernels.reference.q8_activations``)."""
        return "float"

    def with_activations(self, activations: str) -> Fp8Weight:
        """Itself: the CPU's FP8 kernel takes float32 activations in either mode."""
        del activations
        return self

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.shape, self.weight.to(device), self.scales.to(device), self.format)

    @property
    def types(self) -> tuple[str, ...]:
        return ("fp8-e4m3-channel",)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in float32 (the reference)."""
        return self.weight.float() * self.scales[:, None]
