"""A weight matrix kept in llama.cpp's block formats (``PackedWeight``), as a GGUF file stores it.

A matrix [N, K] is a stack of row ranges (parts), each in one GGML type, each part's rows its
packed bytes ``[rows, row_bytes]`` (uint8). A single GGUF tensor is one part; fusing q/k/v or
gate/up at load stacks their parts (in mixed files such as Q4_K_M, v and down are Q6_K while q
and k are Q4_K, so a fused matrix may hold several types). Nothing here dequantizes a whole
matrix except ``dequantize`` itself, the reference the kernels are checked against.

A part's bytes are in one of two layouts: ``ROWS``, as the file stores them (row r at
``data[r]``), or ``LANES8``, the same blocks repacked at load so that 8 rows sit side by side in
a vector's lanes (Q4_0, Q4_1 and Q8_0 rows for the 8-bit kernels, where the CPU prefers it:
``csrc/q8_lanes8_cpu.c`` documents the layout). Repacking is the last step of a load: stacking
and permuting take rows only, and every reader here gives the same values in either layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tidegate.kernels.reference.q8_activations import check_activations

# The types the packed kernels compute (kernels/cpu/csrc/packed_linear_cpu.c), by GGML type id.
PACKED_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
# Those multiplied with 8-bit activations in the "int8" mode (csrc/q8_linear_cpu.c); float
# matrices (F32, F16, BF16) always take float activations.
Q8_TYPES = PACKED_TYPES - {GGMLQuantizationType[name] for name in ("F32", "F16", "BF16")}


# The layouts of a part's bytes (see the module's docstring).
ROWS = "rows"
LANES8 = "lanes8"
# Rows per group in LANES8, and the types it holds.
LANES8_ROWS = 8
LANES8_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0"))


class UnsupportedType(ValueError):
    """A GGML type the packed kernels do not implement."""


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of ``cols`` values; raises ``UnsupportedType`` or ``ValueError``."""
    kind = _type(qtype)
    block, size = GGML_QUANT_SIZES[kind]
    if cols % block:
        raise ValueError(f"{kind.name} rows hold whole blocks of {block}; {cols} columns do not")
    return cols // block * size


@dataclass(frozen=True)
class Part:
    """Rows of one GGML type: ``data`` [rows, row_bytes] uint8, contiguous, in ``layout``
    (``ROWS``: row r is ``data[r]``; ``LANES8``: the same bytes, 8 rows to a group)."""

    qtype: int
    data: torch.Tensor
    layout: str = ROWS

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def as_rows(self, cols: int) -> Part:
        """This part in the ``ROWS`` layout (itself when it is)."""
        if self.layout == ROWS:
            return self
        return Part(self.qtype, torch.from_numpy(lanes8_to_rows(self.data.numpy(), self.qtype,
                                                                cols)))


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] matrix as packed row ranges (``parts``, top to bottom), and the activations the
    CPU multiplies it with (``tidegate.kernels.reference.q8_activations``: "float" or "int8")."""

    shape: tuple[int, int]
    parts: tuple[Part, ...]
    activations: str = "float"

    def __post_init__(self) -> None:
        check_activations(self.activations)

    def with_activations(self, activations: str) -> PackedWeight:
        """The same matrix multiplied with ``activations``; float activations read the rows
        layout, so repacked parts go back to it."""
        if activations != "int8" and any(p.layout != ROWS for p in self.parts):
            return replace(self, activations=activations,
                           parts=tuple(p.as_rows(self.shape[1]) for p in self.parts))
        return replace(self, activations=activations)

    def takes_int8(self, part: Part) -> bool:
        """Whether ``part`` multiplies 8-bit activations: the "int8" mode, a quantized type,
        rows of whole blocks of 32."""
        return self.activations == "int8" and part.qtype in Q8_TYPES and self.shape[1] % 32 == 0

    @classmethod
    def from_bytes(cls, qtype: int, shape: tuple[int, int], data: torch.Tensor | np.ndarray
                   ) -> PackedWeight:
        """One GGUF tensor: ``shape`` (rows, cols) and its bytes (any shape of uint8)."""
        rows, cols = shape
        width = row_bytes(qtype, cols)
        tensor = torch.as_tensor(data) if isinstance(data, torch.Tensor) else torch.from_numpy(
            np.ascontiguousarray(data))
        if tensor.dtype != torch.uint8 or tensor.numel() != rows * width:
            raise ValueError(f"{_type(qtype).name} [{rows}, {cols}] needs {rows * width} bytes, "
                             f"got {tensor.numel()} of {tensor.dtype}")
        return cls((rows, cols), (Part(int(qtype), tensor.reshape(rows, width).contiguous()),))

    @classmethod
    def cat(cls, weights: list[PackedWeight]) -> PackedWeight:
        """The matrices stacked row-wise (q, k, v -> qkv); adjacent parts of one type merge."""
        cols = {w.shape[1] for w in weights}
        if len(cols) != 1:
            raise ValueError(f"cannot stack matrices of {sorted(cols)} columns")
        parts: list[Part] = []
        if any(p.layout != ROWS for w in weights for p in w.parts):
            raise ValueError("repacked matrices are not stacked: stack the rows, then repack")
        for part in (p for w in weights for p in w.parts):
            if parts and parts[-1].qtype == part.qtype:
                parts[-1] = Part(part.qtype, torch.cat([parts[-1].data, part.data]))
            else:
                parts.append(part)
        return cls((sum(w.shape[0] for w in weights), cols.pop()), tuple(parts),
                   weights[0].activations)

    def permute_rows(self, order: torch.Tensor) -> PackedWeight:
        """Rows reordered within one part (llama.cpp's q/k interleave undone at load)."""
        if len(self.parts) != 1:
            raise ValueError("rows are permuted per GGUF tensor, before stacking")
        part = self.parts[0]
        if part.layout != ROWS:
            raise ValueError("a repacked matrix's rows are not permuted: permute, then repack")
        return PackedWeight(self.shape, (Part(part.qtype, part.data[order].contiguous()),),
                            self.activations)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(_type(p.qtype).name for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in float32 (the reference; llama.cpp's values, via gguf-py)."""
        return torch.cat([_dequantize_part(p, self.shape[1]) for p in self.parts])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` in float32, only those rows dequantized (the reference of embedding
        lookups)."""
        out = torch.empty(ids.numel(), self.shape[1])
        ids = ids.reshape(-1).long()
        start = 0
        for part in self.parts:
            mine = (ids >= start) & (ids < start + part.rows)
            if bool(mine.any()):
                rows = part.as_rows(self.shape[1]).data
                picked = Part(part.qtype, rows[ids[mine] - start])
                out[mine] = _dequantize_part(picked, self.shape[1])
            start += part.rows
        return out


def _type(qtype: int) -> GGMLQuantizationType:
    try:
        kind = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedType(f"unknown GGML type {qtype}") from None
    if kind not in PACKED_TYPES:
        names = ", ".join(sorted(t.name for t in PACKED_TYPES))
        raise UnsupportedType(f"GGML type {kind.name} is not implemented (packed types: {names})")
    return kind


def lanes8_to_rows(data: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """A ``LANES8`` part's bytes [rows, row_bytes] back in the ``ROWS`` layout (the reference
    of the C repacking, ``tidegate_q8_repack_lanes8``)."""
    kind = _type(qtype)
    if kind not in LANES8_TYPES:
        raise UnsupportedType(f"{kind.name} has no lanes8 layout")
    rows, width = data.shape
    blocks = cols // 32
    block = width // blocks  # bytes of one row's block: 18, 20 or 34
    head = 4 if kind == GGMLQuantizationType.Q4_1 else 2  # scale (and minimum) per row
    # Per group and block: the rows' heads, each field for the 8 rows in turn, then the
    # codes, 4 bytes of each row in turn per 32-byte vector.
    g = data.reshape(rows // LANES8_ROWS, blocks, LANES8_ROWS * block)
    fields = g[..., : LANES8_ROWS * head].reshape(-1, blocks, head // 2, LANES8_ROWS, 2)
    codes = g[..., LANES8_ROWS * head:].reshape(-1, blocks, (block - head) // 4, LANES8_ROWS, 4)
    out = np.concatenate([fields.transpose(0, 3, 1, 2, 4).reshape(-1, blocks, head),
                          codes.transpose(0, 3, 1, 2, 4).reshape(-1, blocks, block - head)],
                         axis=2)
    return np.ascontiguousarray(out.reshape(rows, width))


def _dequantize_part(part: Part, cols: int) -> torch.Tensor:
    part = part.as_rows(cols)
    kind = _type(part.qtype)
    raw = part.data.numpy()
    if kind == GGMLQuantizationType.F32:
        values = raw.view(np.float32).reshape(part.rows, cols)
    else:
        values = gguf_dequantize(raw, kind).reshape(part.rows, cols)
    return torch.from_numpy(np.array(values, dtype=np.float32))
