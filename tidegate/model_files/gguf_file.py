"""A GGUF file's header: its metadata and where each tensor lies, read with the standard library.

``gguf.GGUFReader`` builds a numpy view for every part of every field, which takes seconds on a
49k-token vocabulary; the HTTP API reads the tokenizer from here at start-up, so this reader walks
the header once with ``struct`` and stops before the tensor data. The worker turns the tensor
positions into arrays itself (``worker/models/loaders/gguf_weights.py``).
"""

from __future__ import annotations

import mmap
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec, "gguf_metadata_value_type").
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_SCALARS: dict[int, struct.Struct] = {
    _UINT8: struct.Struct("<B"), _INT8: struct.Struct("<b"),
    _UINT16: struct.Struct("<H"), _INT16: struct.Struct("<h"),
    _UINT32: struct.Struct("<I"), _INT32: struct.Struct("<i"),
    _FLOAT32: struct.Struct("<f"), _BOOL: struct.Struct("<?"),
    _UINT64: struct.Struct("<Q"), _INT64: struct.Struct("<q"),
    _FLOAT64: struct.Struct("<d"),
}
_ARRAY_CODES = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
                _FLOAT32: "f", _UINT64: "Q", _INT64: "q", _FLOAT64: "d", _BOOL: "B"}
_U64 = _SCALARS[_UINT64]


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, old version, truncated)."""


class GGUFTruncatedError(GGUFFormatError):
    """The header runs past the end of the file: a cut file, or the first bytes of one (the
    API fetches a Hub GGUF's header alone, growing the prefix until this stops)."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute position of the tensor's first byte in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch/numpy shape: outermost dimension first."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # arrays come back as lists, unless skipped (then absent)
    tensors: list[GGUFTensorInfo]

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self) -> str:
        (length,) = _U64.unpack_from(self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        if self.pos > len(self.buf):
            raise GGUFTruncatedError("string runs past the end of the file")
        return self.buf[start:self.pos].decode("utf-8", errors="replace")

    def array(self, keep: bool) -> list[Any] | None:
        kind = self.scalar(_UINT32)
        (count,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        if kind == _STRING:
            if keep:
                return [self.string() for _ in range(count)]
            for _ in range(count):
                (length,) = _U64.unpack_from(self.buf, self.pos)
                self.pos += 8 + length
            return None
        if kind == _ARRAY:
            items = [self.array(keep) for _ in range(count)]
            return items if keep else None
        code = _ARRAY_CODES.get(kind)
        if code is None:
            raise GGUFFormatError(f"unknown array item type {kind}")
        values = array(code)
        end = self.pos + values.itemsize * count
        if end > len(self.buf):  # else a cut array would come back short, silently
            raise GGUFTruncatedError("array runs past the end of the file")
        if keep:
            values.frombytes(self.buf[self.pos:end])
        self.pos = end
        if not keep:
            return None
        return [bool(v) for v in values] if kind == _BOOL else values.tolist()


def read_gguf_header(
    path: str | Path, *, arrays: bool = True, tensors: bool = True
) -> GGUFHeader:
    """Read a GGUF file's metadata (and tensor positions); ``arrays=False`` leaves arrays out.

    Raises ``GGUFFormatError`` for a file that is not GGUF, is big-endian or is truncated, and
    ``OSError`` when the file cannot be opened.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise GGUFFormatError("file is empty") from exc
    with buf:
        try:
            return _parse(buf, path, arrays, tensors)
        except struct.error as exc:
            raise GGUFTruncatedError("file is truncated") from exc


def _parse(buf: mmap.mmap, path: Path, arrays: bool, tensors: bool) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar(_UINT32)
    if version not in (2, 3):
        # Version 1 used 32-bit counts; a big-endian file reads as a huge version number.
        raise GGUFFormatError(f"unsupported GGUF version {version} (need 2 or 3, little-endian)")
    n_tensors, n_kv = cur.scalar(_UINT64), cur.scalar(_UINT64)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        kind = cur.scalar(_UINT32)
        if kind == _ARRAY:
            value = cur.array(arrays)
            if value is not None:
                metadata[key] = value
        else:
            metadata[key] = cur.scalar(kind)
    if cur.pos > len(buf):  # a skipped array of strings ran past the end
        raise GGUFTruncatedError("metadata runs past the end of the file")
    infos: list[GGUFTensorInfo] = []
    if tensors:
        raw = [_tensor_info(cur) for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        infos = [GGUFTensorInfo(name, dims, kind, data_start + off)
                 for name, dims, kind, off in raw]
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=infos)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.scalar(_UINT32)
    dims = tuple(cur.scalar(_UINT64) for _ in range(n_dims))
    return name, dims, cur.scalar(_UINT32), cur.scalar(_UINT64)
