"""AutoAWQ checkpoints in the GEMM layout (4-bit): ``AWQFormat`` reads a linear's ``qweight``,
``qzeros`` and ``scales`` into an ``IntWeight``, undoing AutoAWQ's interleaved column order
(``AWQ_ORDER``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.loaders.quantized.checkpoint_tensors import (
    FLOATS,
    CheckpointTensors,
    check_divides,
    unpack_words,
)

# AutoAWQ packs output column 8c + AWQ_ORDER[i] into field i of word c; AWQ_FIELD inverts it.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_FIELD = (0, 4, 1, 5, 2, 6, 3, 7)


class AWQFormat:
    """AutoAWQ's GEMM layout (``version: gemm``), 4-bit. Per linear: ``qweight`` int32 [K, N/8],
    packed along N; ``qzeros`` int32 [K/G, N/8], packed the same way; ``scales`` [K/G, N]. Field i
    of word c (bits 4i..4i+3) holds output column 8c + AWQ_ORDER[i]; zeros are stored as they are
    (``zero_point: false`` checkpoints without qzeros: zero 8)."""

    name = "awq"
    owned = ("qweight", "qzeros", "scales")
    markers = (".qweight", ".qzeros")

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        if version != "gemm" or str(config.get("backend", "")).lower() == "llm-awq":
            raise ModelLoadError(f"{where}: AWQ version {version!r} is not supported (gemm)")
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if bits != 4:
            raise ModelLoadError(f"{where}: AWQ quantization_config.bits {bits} is not "
                                 "supported (4)")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if self.group_size != -1 and self.group_size <= 0:
            raise ModelLoadError(f"{where}: AWQ quantization_config.group_size "
                                 f"{self.group_size} is not a positive size or -1")
        self.zero_point = bool(config.get("zero_point", True))

    def quantized(self, module: str, tensors: CheckpointTensors) -> bool:
        return tensors.has(f"{module}.qweight")

    def read(self, module: str, shape: tuple[int, int], tensors: CheckpointTensors) -> IntWeight:
        n, k = shape
        g = k if self.group_size == -1 else self.group_size
        check_divides(f"{tensors.raw.path}: {module} (awq)", shape, g, 8)
        qweight = tensors.get(f"{module}.qweight", (torch.int32,), (k, n // 8))
        scales = tensors.get(f"{module}.scales", FLOATS, (k // g, n))
        q = _awq_columns(unpack_words(qweight, 4, dim=1)).t()  # [N, K]
        if tensors.has(f"{module}.qzeros") or self.zero_point:
            qzeros = tensors.get(f"{module}.qzeros", (torch.int32,), (k // g, n // 8))
            zeros = _awq_columns(unpack_words(qzeros, 4, dim=1)).t()
        else:
            zeros = torch.full((n, k // g), 8, dtype=torch.int32)
        return IntWeight.from_ints(q.contiguous(), scales.float().t(), zeros.contiguous(), 4,
                                   format="awq")


def _awq_columns(fields: torch.Tensor) -> torch.Tensor:
    """[R, N] fields in word order -> [R, N] in output column order."""
    rows, cols = fields.shape
    return fields.view(rows, cols // 8, 8)[:, :, list(AWQ_FIELD)].reshape(rows, cols)
