"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum; formats v1 and v2): ``GPTQFormat`` reads a
linear's ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` into an ``IntWeight``, honouring
GPTQModel's ``dynamic`` per-module overrides."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.loaders.quantized.checkpoint_tensors import (
    FLOATS,
    CheckpointTensors,
    act_order,
    check_divides,
    unpack_words,
)


class GPTQFormat:
    """GPTQ (AutoGPTQ, GPTQModel, optimum). Per linear: ``qweight`` int32 [K/p, N] with p = 32/bits
    values a word, packed along K (input column k is field k % p of row k // p; field i sits at
    bits i*bits); ``qzeros`` int32 [K/G, N/p], packed the same way along N; ``scales`` [K/G, N];
    ``g_idx`` int32 [K], the group of each input column (act-order when it is not k // G). Format
    v1 ("gptq", the default) stores zero - 1, v2 ("gptq_v2") the zero itself. GPTQModel's
    ``dynamic`` per-module overrides (bits, group_size, desc_act, sym) are honoured."""

    name = "gptq"
    owned = ("qweight", "qzeros", "scales", "g_idx")
    markers = (".qweight", ".qzeros")

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        self.where = where
        self.config = config
        stored = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if stored not in ("gptq", "gptq_v2") or config.get("is_marlin_format"):
            stored = "marlin" if config.get("is_marlin_format") else stored
            raise ModelLoadError(f"{where}: GPTQ checkpoint_format {stored!r} is not supported "
                                 "(gptq, gptq_v2)")
        self.zero_offset = 1 if stored == "gptq" else 0
        self.dynamic = config.get("dynamic") or {}
        if not isinstance(self.dynamic, dict):
            raise ModelLoadError(f"{where}: GPTQ quantization_config.dynamic is not an object")
        self._args(dict(config), "quantization_config")  # refuse a bad base config up front

    def quantized(self, module: str, tensors: CheckpointTensors) -> bool:
        return tensors.has(f"{module}.qweight")

    def read(self, module: str, shape: tuple[int, int], tensors: CheckpointTensors) -> IntWeight:
        bits, group_size, desc_act = self._module_args(module)
        n, k = shape
        p, g = 32 // bits, (k if group_size == -1 else group_size)
        check_divides(f"{tensors.raw.path}: {module} (gptq)", shape, g, p)
        qweight = tensors.get(f"{module}.qweight", (torch.int32,), (k // p, n))
        qzeros = tensors.get(f"{module}.qzeros", (torch.int32,), (k // g, n // p))
        scales = tensors.get(f"{module}.scales", FLOATS, (k // g, n))
        q = unpack_words(qweight, bits, dim=0).t()  # [N, K], input column order
        zeros = unpack_words(qzeros, bits, dim=1).t() + self.zero_offset  # [N, K/G]
        if self.zero_offset and int(zeros.max()) >= 1 << bits:
            raise ModelLoadError(f"{tensors.raw.path}: tensor {module}.qzeros (gptq v1) holds a "
                                 "zero point of 0, which v1 cannot store (stored as -1)")
        perm = None
        if tensors.has(f"{module}.g_idx"):
            g_idx = tensors.get(f"{module}.g_idx", (torch.int32, torch.int64), (k,))
            perm = act_order(g_idx, g, f"{tensors.raw.path}: tensor {module}.g_idx (gptq)")
        elif desc_act and k // g > 1:
            raise ModelLoadError(f"{tensors.raw.path}: tensor {module}.g_idx (gptq) is missing "
                                 "and desc_act is true")
        if perm is not None:
            q = q[:, perm]
        return IntWeight.from_ints(q.contiguous(), scales.float().t(), zeros, bits, perm=perm,
                                   format="gptq")

    def _module_args(self, module: str) -> tuple[int, int, bool]:
        """(bits, group size, desc_act) of ``module``: the base config or the first ``dynamic``
        rule whose pattern matches it (vLLM's and GPTQModel's re.match)."""
        for pattern, override in self.dynamic.items():
            if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), module):
                if not isinstance(override, dict):
                    raise ModelLoadError(f"{self.where}: GPTQ dynamic[{pattern!r}] is not an "
                                         "object")
                return self._args({**self.config, **override}, f"dynamic[{pattern!r}]")
        return self._args(dict(self.config), "quantization_config")

    def _args(self, config: dict[str, Any], field: str) -> tuple[int, int, bool]:
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ModelLoadError(f"{self.where}: GPTQ {field}.bits {bits} is not supported "
                                 "(4, 8)")
        group_size = int(config.get("group_size", 128))
        if group_size != -1 and group_size <= 0:
            raise ModelLoadError(f"{self.where}: GPTQ {field}.group_size {group_size} is not "
                                 "a positive size or -1")
        return bits, group_size, bool(config.get("desc_act", False))
