"""A quantized Hugging Face checkpoint as HF-named tensors: ``quantization_config`` finds the
checkpoint's settings, ``checkpoint_format`` picks the format's reader, and
``QuantizedSafetensors`` gives a quantized linear both ways: ``quantized_weight`` (the integers
or FP8 values as stored, for their kernels) and ``__getitem__`` (dequantized to float32, as the
GGUF reader does for accelerators); every other tensor reads as stored."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError, hf_config
from tidegate.worker.models.loaders.hf_weights import SafetensorsWeights
from tidegate.worker.models.loaders.quantized.awq_format import AWQFormat
from tidegate.worker.models.loaders.quantized.checkpoint_tensors import (
    CheckpointFormat,
    CheckpointTensors,
    linear_shapes,
)
from tidegate.worker.models.loaders.quantized.compressed_tensors_format import (
    CompressedTensorsFormat,
)
from tidegate.worker.models.loaders.quantized.float_format import Fp8Format
from tidegate.worker.models.loaders.quantized.gptq_format import GPTQFormat


def quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization settings: config.json's ``quantization_config`` (or the
    older compressed-tensors ``compression_config``), else AutoGPTQ's quantize_config.json
    beside it; None for a float checkpoint."""
    config = hf_config(model_dir)
    found = config.get("quantization_config")
    if found is None and (found := config.get("compression_config")) is not None:
        found = {"quant_method": "compressed-tensors", **found}
    side = model_dir / "quantize_config.json"
    if found is None and side.is_file():
        try:
            found = {"quant_method": "gptq", **json.loads(side.read_text())}
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{side}: cannot read: {exc}") from exc
    if found is not None and not isinstance(found, dict):
        raise ModelLoadError(f"{model_dir / 'config.json'}: quantization_config is not an object")
    return found


def checkpoint_format(config: Mapping[str, Any], where: str) -> CheckpointFormat:
    """The reader of ``quantization_config`` ``config``'s format; refuses any other."""
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        return GPTQFormat(config, where)
    if method == "awq":
        return AWQFormat(config, where)
    if method in ("compressed-tensors", "compressed_tensors"):
        return CompressedTensorsFormat(config, where)
    if method == "fp8":
        return Fp8Format(config, where)
    raise ModelLoadError(f"{where}: quantization_config.quant_method {method!r} is not "
                         "supported (gptq, awq, compressed-tensors, fp8)")


class QuantizedSafetensors(Mapping[str, torch.Tensor]):
    """The HF-named tensors of a quantized checkpoint; a quantized linear's weight name gives
    its stored values (``quantized_weight``) or, looked up, its dequantized float32 matrix."""

    def __init__(self, model_dir: Path) -> None:
        found = quantization_config(model_dir)
        if found is None:
            raise ModelLoadError(f"{model_dir / 'config.json'}: no quantization_config")
        self.path = model_dir
        self.quantization = found
        self.raw = SafetensorsWeights(model_dir)
        self.config = self.raw.config
        self.family, self.sources = self.raw.family, self.raw.sources
        self.format = checkpoint_format(found, f"{model_dir / 'config.json'}")
        self._tensors = CheckpointTensors(self.raw, self.format.name)
        # HF weight name -> (N, K) of each linear the checkpoint stores quantized
        self.quantized = {name: shape for name, shape in linear_shapes(self.config).items()
                          if self.format.quantized(name.removesuffix(".weight"), self._tensors)}
        self._hidden = {f"{name.removesuffix('weight')}{suffix}" for name in self.quantized
                        for suffix in self.format.owned}
        for name in self.raw:
            if name.endswith(self.format.markers) and name not in self._hidden:
                raise ModelLoadError(f"{model_dir}: tensor {name} ({self.format.name}) is not "
                                     "a linear of this Llama model")
        self._names = [n for n in self.raw if n not in self._hidden]
        self._names += sorted(self.quantized.keys() - set(self._names))

    def quantized_weight(self, hf_name: str) -> IntWeight | Fp8Weight | None:
        """The linear ``hf_name`` (``model.layers.3.self_attn.q_proj.weight``) as stored, or
        None where it is not quantized."""
        shape = self.quantized.get(hf_name)
        if shape is None:
            return None
        module = hf_name.removesuffix(".weight")
        try:
            return self.format.read(module, shape, self._tensors)
        except ModelLoadError:
            raise
        except ValueError as exc:  # the weights' own checks (value ranges, group sizes)
            raise ModelLoadError(f"{self.path}: {module} ({self.format.name}): {exc}") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self.quantized_weight(name)
        if weight is not None:
            return weight.dequantize()
        if name in self._hidden:
            raise KeyError(name)
        return self.raw[name]

    def __contains__(self, name: object) -> bool:
        return name in self.quantized or (name in self.raw and name not in self._hidden)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
