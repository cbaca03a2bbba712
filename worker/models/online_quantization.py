"""Quantization at load time (``--quantize``): a float model's decoder projections rounded to
nearest, in place, on the device the model is on, before the engine starts.

What vLLM's ``--quantization fp8`` does for a bf16 checkpoint, for the formats the kernels read:
``fp8`` (e4m3, a scale per output channel: W8A8 on the GPU), ``rtn-int8`` (one scale per output
channel) and ``rtn-int4`` (symmetric, groups of 128 where they divide every projection, else 64
or 32). Embeddings, norms and the LM head stay float, as in ``tidegate quantize``'s checkpoints,
which calibrate (GPTQ, AWQ) where this cannot; benchmarks quantize random-weight models here.
The loader applies it (``load_model(quantize=...)``); ``tidegate.worker.quantization`` builds
on it (``auto_group``), never the other way round.
"""

from __future__ import annotations

from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel, layer_matrices
from tidegate.worker.models.packed_modules import PackedLinear

METHODS = ("fp8", "rtn-int8", "rtn-int4")
# Tried largest first for 4 bits: the first that divides every projection's input width
# (SmolLM2-135M's 576 takes 64).
AUTO_GROUPS = (128, 64, 32)


def auto_group(config: ModelConfig) -> int | None:
    """The 4-bit group size for ``config``'s projections: the first of ``AUTO_GROUPS`` that
    divides their input widths (hidden size, attention width, intermediate size), or None."""
    widths = (config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size)
    return next((g for g in AUTO_GROUPS if all(w % g == 0 for w in widths)), None)


def quantize_model_at_load(model: DecoderModel, method: str) -> int:
    """``method`` (one of ``METHODS``) applied to ``model``'s float projections; returns how
    many matrices were quantized."""
    if method == "fp8":
        return quantize_loaded(model, "fp8")
    if method == "rtn-int8":
        return quantize_loaded(model, 8)
    if method == "rtn-int4":
        if (group := auto_group(model.cfg)) is None:
            raise ValueError(f"rtn-int4: no group size of {AUTO_GROUPS} divides the model's "
                             "projections")
        return quantize_loaded(model, 4, group)
    raise ValueError(f"quantize must be one of {', '.join(METHODS)}, got {method!r}")


def quantize_loaded(model: DecoderModel, bits: int | str, group_size: int | None = None,
                    symmetric: bool = True) -> int:
    """Round-to-nearest quantization of a loaded model's decoder projections in place, on its
    device. ``bits``: 4 or 8 (integers in groups of ``group_size``, None: one per row), or
    "fp8" (e4m3, a scale per output channel). Matrices already quantized are left as they are.
    Returns how many matrices were quantized."""
    if bits == "fp8" and (group_size is not None or not symmetric):
        raise ValueError("fp8 has one symmetric scale per output channel")
    count = 0
    for i, layer in enumerate(model.layers):
        for attr, _, _ in layer_matrices(i):
            module = getattr(layer, attr)
            if isinstance(module, PackedLinear):
                continue
            weight = (Fp8Weight.quantize(module.weight.data) if bits == "fp8" else
                      IntWeight.quantize(module.weight.data, int(bits), group_size, symmetric))
            setattr(layer, attr, PackedLinear(weight))
            del module
            count += 1
    return count
