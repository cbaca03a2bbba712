"""A weight matrix of 4- or 8-bit integers with a scale and zero point per group (``IntWeight``).

This is the one in-memory layout of the weight-only integer formats Hugging Face checkpoints
carry (GPTQ, AWQ, compressed-tensors pack-quantized, and ``tidegate quantize``'s RTN): each
loader repacks its file's integers into it, so one CPU kernel and one Triton kernel serve all
of them, and nothing is ever dequantized to a float matrix except by ``dequantize``, the
reference the kernels are checked against.

Layout of a [N, K] matrix, groups of G columns (G = K: one group per row; otherwise G is a
multiple of 16, and for 4 bits 16 or a multiple of 32, so groups and 32-column runs nest):

* ``qweight`` uint8: 8 bits, [N, K], one value per byte; 4 bits, [N, K / 2], each run of 32
  columns in 16 bytes, the low nibbles holding columns 0-15 and the high nibbles 16-31 (GGML's
  Q4 layout, so a 16-byte load yields two runs of 16 consecutive columns);
* ``scales`` float32 [N, K / G] and ``zeros`` uint8 [N, K / G]: the value at (n, k) is
  ``(q[n, k] - zeros[n, k // G]) * scales[n, k // G]`` (symmetric formats store the midpoint,
  8 or 128, as every zero);
* ``perm`` (act-order GPTQ, None otherwise) int64 [K]: stored column j holds input column
  ``perm[j]``, sorted so that groups are runs of G; a product then reads ``x[:, perm]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tidegate.kernels.reference.q8_activations import check_activations

BITS = (4, 8)


@dataclass(frozen=True)
class IntWeight:
    """A [N, K] matrix of ``bits``-bit integers, scaled per group of ``group_size`` columns."""

    shape: tuple[int, int]
    bits: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None = None
    format: str = "int"  # where the integers came from (gptq, awq, compressed-tensors, rtn)
    # What the CPU multiplies it with (tidegate.kernels.reference.q8_activations): "float" or "int8".
    activations: str = "float"

    def __post_init__(self) -> None:
        check_activations(self.activations)
        n, k = self.shape
        g = self.group_size
        if self.bits not in BITS:
            raise ValueError(f"{self.bits}-bit integers are not implemented (bits: 4, 8)")
        if g <= 0 or k % g:
            raise ValueError(f"group size {g} does not divide {k} columns")
        if self.bits == 4 and k % 32:
            raise ValueError(f"4-bit rows hold runs of 32 columns; {k} columns do not")
        if g != k and g % 16:
            raise ValueError(f"groups of {g} columns: a group is a multiple of 16 columns or "
                             "the whole row")
        if self.bits == 4 and g != k and g % 32 and g != 16:
            raise ValueError(f"4-bit groups of {g} columns do not fit runs of 32 columns")
        width = k * self.bits // 8
        expect = {"qweight": ((n, width), torch.uint8), "scales": ((n, k // g), torch.float32),
                  "zeros": ((n, k // g), torch.uint8)}
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} "
                                 f"{list(t.shape)}")
        if self.perm is not None and (self.perm.shape != (k,) or self.perm.dtype != torch.int64):
            raise ValueError(f"perm must be int64 [{k}]")

    @classmethod
    def from_ints(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                  perm: torch.Tensor | None = None, format: str = "int") -> IntWeight:
        """From unpacked integers ``q`` [N, K] (0 .. 2**bits - 1, in stored column order),
        ``scales`` and ``zeros`` [N, K / G] (the group size follows from their width)."""
        n, k = q.shape
        groups = scales.shape[1]
        if bits not in BITS:
            raise ValueError(f"{bits}-bit integers are not implemented (bits: 4, 8)")
        if bits == 4 and k % 32:
            raise ValueError(f"4-bit rows hold runs of 32 columns; {k} columns do not")
        if groups == 0 or k % groups:
            raise ValueError(f"{groups} groups do not divide {k} columns")
        top = (1 << bits) - 1
        if q.numel() and (int(q.min()) < 0 or int(q.max()) > top):
            raise ValueError(f"{bits}-bit values must lie in 0..{top}")
        if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) > top):
            raise ValueError(f"{bits}-bit zero points must lie in 0..{top}")
        return cls((n, k), bits, k // groups, pack(q, bits), scales.float().contiguous(),
                   zeros.to(torch.uint8).contiguous(), perm, format)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int, group_size: int | None = None,
                 symmetric: bool = True) -> IntWeight:
        """Round-to-nearest quantization of a float [N, K] matrix (``group_size`` None: one
        group per row). Symmetric: zero at the midpoint, scale max|w| / (2**(bits-1) - 1);
        asymmetric: the group's [min, max] over 0 .. 2**bits - 1."""
        q, scales, zeros = rtn(weight, bits, group_size, symmetric)
        return cls.from_ints(q, scales, zeros, bits, format="rtn")

    @classmethod
    def cat(cls, weights: list[IntWeight]) -> IntWeight:
        """Matrices stacked row-wise (q, k, v -> qkv); they must share bits, groups and
        column order (act-order GPTQ gives q/k/v, and gate/up, the same order: the same
        inputs)."""
        first = weights[0]
        for w in weights[1:]:
            same_perm = (w.perm is None and first.perm is None) or (
                w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm))
            if (w.bits, w.group_size, w.shape[1]) != (first.bits, first.group_size,
                                                      first.shape[1]) or not same_perm:
                raise ValueError("fused matrices differ in bits, group size, columns or "
                                 "act-order column order")
        if len(weights) == 1:
            return first
        return cls((sum(w.shape[0] for w in weights), first.shape[1]), first.bits,
                   first.group_size, torch.cat([w.qweight for w in weights]),
                   torch.cat([w.scales for w in weights]), torch.cat([w.zeros for w in weights]),
                   first.perm, first.format, first.activations)

    def to(self, device: torch.device | str) -> IntWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return IntWeight(self.shape, self.bits, self.group_size, self.qweight.to(device),
                         self.scales.to(device), self.zeros.to(device), move(self.perm),
                         self.format, self.activations)

    def with_activations(self, activations: str) -> IntWeight:
        return replace(self, activations=activations)

    @property
    def takes_int8(self) -> bool:
        """Whether the CPU multiplies 8-bit activations: the "int8" mode, rows of whole blocks
        of 32, groups of whole steps of 16 columns."""
        return (self.activations == "int8" and self.shape[1] % 32 == 0
                and self.group_size % 16 == 0)

    @property
    def types(self) -> tuple[str, ...]:
        group = "channel" if self.group_size == self.shape[1] else f"g{self.group_size}"
        order = "-act" if self.perm is not None else ""
        return (f"int{self.bits}-{group}{order}",)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        extra = 0 if self.perm is None else self.perm.numel() * 8
        return (self.qweight.numel() + self.scales.numel() * 4 + self.zeros.numel() + extra)

    def ints(self) -> torch.Tensor:
        """The integers [N, K] as int32, in stored column order."""
        return unpack(self.qweight, self.bits, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in float32, columns in input order (the reference)."""
        g = self.group_size
        scales = self.scales.repeat_interleave(g, dim=1)
        zeros = self.zeros.to(torch.int32).repeat_interleave(g, dim=1)
        values = (self.ints() - zeros).float() * scales
        if self.perm is None:
            return values
        out = torch.empty_like(values)
        out[:, self.perm] = values
        return out


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers [N, K] (0 .. 2**bits - 1) -> ``qweight`` bytes (the layout above)."""
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    n, k = q.shape
    runs = q.reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(qweight: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``qweight`` bytes -> integers [N, K] as int32."""
    if bits == 8:
        return qweight.to(torch.int32)
    n = qweight.shape[0]
    runs = qweight.reshape(n, cols // 32, 1, 16).to(torch.int32)
    return torch.cat([runs & 0xF, runs >> 4], dim=2).reshape(n, cols)


def rtn(weight: torch.Tensor, bits: int, group_size: int | None = None, symmetric: bool = True
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: (q [N, K] int32 in 0 .. 2**bits - 1, scales float32 [N, K / G],
    zeros int32 [N, K / G]) with ``weight ~= (q - zero) * scale`` per group."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit integers are not implemented (bits: 4, 8)")
    n, k = weight.shape
    g = k if group_size in (None, -1) else int(group_size)
    if g <= 0 or k % g:
        raise ValueError(f"group size {g} does not divide {k} columns")
    w = weight.detach().float().reshape(n, k // g, g)
    top = (1 << bits) - 1
    if symmetric:
        mid = 1 << (bits - 1)
        scales = w.abs().amax(dim=2) / (mid - 1)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.full_like(scales, mid, dtype=torch.int32)
    else:
        lo = w.amin(dim=2).clamp(max=0.0)
        hi = w.amax(dim=2).clamp(min=0.0)
        scales = (hi - lo) / top
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.round(-lo / scales).clamp(0, top).to(torch.int32)
    q = torch.round(w / scales[..., None]) + zeros[..., None]
    return q.clamp(0, top).to(torch.int32).reshape(n, k), scales, zeros
