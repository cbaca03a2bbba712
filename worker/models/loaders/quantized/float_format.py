"""FP8 checkpoints into ``tidegate.kernels.weights.fp8_weight.Fp8Weight``: the e4m3 linears of compressed-tensors'
``float-quantized`` schemes (llm-compressor's FP8 and FP8_DYNAMIC: ``fp8_scheme`` checks a
config group, ``read_fp8`` a linear's tensors) and the plain ``quant_method: "fp8"`` configs
vLLM reads (``Fp8Format``: AutoFP8, per-tensor scales).

A linear stores ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` (per tensor: [] or [1];
per channel: [N, 1]), value = float(weight) * scale, and with static activations an
``input_scale`` per tensor. Activations are not read at that scale: the GPU kernels quantize
them per token at run time (a scale per row of activations, at least as accurate as one
calibrated scale for the whole tensor) and the CPU keeps them in float32, so a static and a
dynamic checkpoint are served alike. Block-wise FP8 (FP8_BLOCK, ``weight_block_size``), FP4 /
NVFP4, e5m2 and FP8 KV-cache scales are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tidegate.kernels.weights.fp8_weight import FP8_DTYPE, Fp8Weight
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.loaders.quantized.checkpoint_tensors import FLOATS, CheckpointTensors

# compressed-tensors formats that hold FP8 weights as float8_e4m3fn tensors named ``weight``
# (naive-quantized: weight-only schemes, which compressed-tensors does not call float-quantized)
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel")
INPUT_STRATEGIES = ("token", "tensor")
PER_TENSOR = ((), (1,), (1, 1))


def fp8_scheme(weights: Mapping[str, Any], inputs: Mapping[str, Any] | None, where: str,
               fmt: str) -> dict[str, Any]:
    """The scheme arguments of a compressed-tensors config group whose weights are ``type:
    float`` (``where`` names the group and its format in errors); refuses what FP8 per tensor
    or per channel cannot serve."""
    if fmt not in FLOAT_FORMATS:
        raise ModelLoadError(f"{where}: float weights in format {fmt!r} are not supported "
                             f"({', '.join(FLOAT_FORMATS)})")
    bits = int(weights.get("num_bits", 8))
    if bits != 8:
        raise ModelLoadError(f"{where}: float num_bits {bits} (FP4, NVFP4) is not supported "
                             "(8: FP8 e4m3)")
    strategy = weights.get("strategy") or "tensor"
    if strategy not in WEIGHT_STRATEGIES:
        label = " (FP8_BLOCK)" if strategy == "block" else ""
        raise ModelLoadError(f"{where}: float strategy {strategy!r}{label} is not supported "
                             f"({', '.join(WEIGHT_STRATEGIES)})")
    if weights.get("symmetric") is False:
        raise ModelLoadError(f"{where}: asymmetric float weights (a zero point) are not "
                             "supported")
    if weights.get("dynamic") not in (False, None):
        raise ModelLoadError(f"{where}: dynamic weight quantization is not supported")
    if inputs:
        _check_inputs(inputs, where)
    return {"type": "float", "bits": 8, "strategy": strategy, "group_size": None,
            "symmetric": True, "act_order": False}


def _check_inputs(inputs: Mapping[str, Any], where: str) -> None:
    """FP8 activations, per token (dynamic) or per tensor (static or dynamic): served the same
    way (see the module docstring)."""
    kind, bits = str(inputs.get("type", "int")), int(inputs.get("num_bits", 8))
    if (kind, bits) != ("float", 8):
        raise ModelLoadError(f"{where}: input_activations {kind} {bits}-bit with FP8 weights "
                             "are not supported (float 8-bit)")
    strategy = inputs.get("strategy") or "tensor"
    if strategy not in INPUT_STRATEGIES:
        raise ModelLoadError(f"{where}: input_activations strategy {strategy!r} is not "
                             f"supported ({', '.join(INPUT_STRATEGIES)})")
    if inputs.get("dynamic") not in (True, False, None):
        raise ModelLoadError(f"{where}: input_activations dynamic {inputs['dynamic']!r} is not "
                             "supported (true, false)")


def read_fp8(module: str, shape: tuple[int, int], tensors: CheckpointTensors, strategy: str,
             fmt: str) -> Fp8Weight:
    """Linear ``module``'s ``weight`` and ``weight_scale`` (``strategy`` tensor or channel) as
    an ``Fp8Weight`` (the e4m3 bytes kept as they are; a tensor scale repeated per row); a
    static ``input_scale`` is checked and left unused."""
    n, k = shape
    weight = tensors.get(f"{module}.weight", (FP8_DTYPE,), (n, k))
    scale_shapes = ((n, 1), (n,)) if strategy == "channel" else PER_TENSOR
    scale = tensors.get(f"{module}.weight_scale", FLOATS, *scale_shapes)
    if tensors.has(f"{module}.input_scale"):
        tensors.get(f"{module}.input_scale", FLOATS, *PER_TENSOR)
    # e4m3fn has no infinities; its NaN is S.1111.111, which no quantizer writes.
    if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():
        raise ModelLoadError(f"{tensors.raw.path}: tensor {module}.weight ({fmt}) holds NaN")
    scales = scale.float().reshape(-1).expand(n).contiguous()
    return Fp8Weight((n, k), weight.contiguous(), scales, format=fmt)


class Fp8Format:
    """vLLM's plain FP8 config (``quant_method: "fp8"``, AutoFP8 and others):
    ``activation_scheme`` dynamic or static, ``ignored_layers`` (or ``modules_to_not_convert``);
    every other linear of the decoder stores ``weight`` e4m3 with a per-tensor ``weight_scale``.
    The LM head is FP8 only where it has a ``weight_scale`` (vLLM never quantizes it)."""

    name = "fp8"
    owned = ("weight_scale", "input_scale")
    markers = (".weight_scale",)

    def __init__(self, config: Mapping[str, Any], where: str) -> None:
        if config.get("weight_block_size") is not None:
            raise ModelLoadError(f"{where}: fp8 quantization_config.weight_block_size "
                                 f"{config['weight_block_size']} (block-wise FP8) is not "
                                 "supported (per-tensor scales)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ModelLoadError(f"{where}: fp8 quantization_config.activation_scheme "
                                 f"{scheme!r} is not supported (dynamic, static)")
        if str(config.get("fmt", "e4m3")).lower() != "e4m3":
            raise ModelLoadError(f"{where}: fp8 quantization_config.fmt {config['fmt']!r} is "
                                 "not supported (e4m3)")
        if config.get("kv_cache_scheme"):
            raise ModelLoadError(f"{where}: fp8 quantization_config.kv_cache_scheme is not "
                                 "supported")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        self.ignored = tuple(str(name) for name in ignored)

    def quantized(self, module: str, tensors: CheckpointTensors) -> bool:
        if any(f".{name}." in f".{module}." for name in self.ignored):
            return False
        if module == "lm_head":
            return tensors.has("lm_head.weight_scale")
        if not tensors.has(f"{module}.weight_scale"):
            raise ModelLoadError(f"{tensors.raw.path}: tensor {module}.weight_scale (fp8) is "
                                 f"missing: the config quantizes {module} and does not ignore "
                                 "it")
        return True

    def read(self, module: str, shape: tuple[int, int], tensors: CheckpointTensors
             ) -> Fp8Weight:
        return read_fp8(module, shape, tensors, "tensor", "fp8")
