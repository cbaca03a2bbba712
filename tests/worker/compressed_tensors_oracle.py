"""compressed-tensors 0.20 as the oracle for its own format: checkpoints it quantizes and saves
itself (as llm-compressor does), and its own decompression of a linear. Optional: the tests that
use it skip where it is not installed (``needs_compressed_tensors``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.worker.tiny_checkpoints import tiny_hf_model

try:
    import compressed_tensors
except ImportError:  # the third-party checks need it; everything else runs without
    compressed_tensors = None
needs_compressed_tensors = pytest.mark.skipif(
    compressed_tensors is None, reason="compressed-tensors is not installed "
    "(pip install --no-deps compressed-tensors==0.20.0 loguru==0.7.3)")
STATIC_INPUT_SCALE = 0.02  # what a calibration would have found for static activations


def write_with_compressed_tensors(path: Path, scheme: str | dict[str, Any]) -> None:
    """Quantize the tiny model with compressed-tensors' own API and save it compressed, as
    llm-compressor does. ``scheme``: a preset's name (``FP8_DYNAMIC``) or QuantizationScheme
    fields (``weights``, ``input_activations``); qparams from each group's (channel's,
    tensor's) min and max."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    hf = tiny_hf_model(tied=False)
    built = (preset_name_to_scheme(scheme, ["Linear"]) if isinstance(scheme, str)
             else QuantizationScheme(targets=["Linear"], **scheme))
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": built}, ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN), show_progress=False)
    for module in hf.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data
        grouped = (w.reshape(1, 1, -1) if args.strategy == "tensor"
                   else w.reshape(w.shape[0], -1, args.group_size) if args.group_size
                   else w[:, None])
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(STATIC_INPUT_SCALE)
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(path)
    compressor.update_config(str(path))


def decompress_with_compressed_tensors(path: Path, module: str) -> torch.Tensor:
    """Linear ``module`` of the checkpoint at ``path``, decompressed by compressed-tensors'
    compressor for its scheme's format, in float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(
        json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    tensors = {k.removeprefix(f"{module}."): v for k, v in load_file(path / "model.safetensors")
               .items() if k.startswith(f"{module}.")}
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    return compressor.decompress(tensors, scheme)["weight"].float()
