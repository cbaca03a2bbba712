"""The quantized linears of a checkpoint in each format's tensor layout, with the format's
``quantization_config`` (``FormatTensors``): compressed-tensors ``pack-quantized`` (integers) and
``float-quantized`` (FP8, as llm-compressor's FP8_DYNAMIC preset writes it), GPTQ (v1 by default;
act-order through ``g_idx``) and AWQ GEMM, each what its other readers (transformers, vLLM) load.
The packing conventions are the ones ``worker/models/loaders/quantized/`` reads, written out
here in the other direction; ``checkpoint_writer`` puts them into a model directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight

# AutoAWQ packs output column 8c + AWQ_ORDER[i] into field i of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The layout of compressed-tensors this writes (its config's "version").
COMPRESSED_TENSORS_VERSION = "0.20.0"
# llm-compressor's FP8_DYNAMIC preset as its config.json spells it: e4m3 weights with a scale per
# output channel, activations quantized to e4m3 per token at run time.
FP8_DYNAMIC_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                       "strategy": "channel", "dynamic": False}
FP8_DYNAMIC_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                      "strategy": "token", "dynamic": True}


@dataclass(frozen=True, slots=True)
class FormatTensors:
    """A format's share of a checkpoint."""

    quantization_config: dict[str, Any]  # config.json's entry
    tensors: dict[str, torch.Tensor]  # the quantized linears, under the format's tensor names



def compressed_tensors_layout(weights: Mapping[str, IntWeight], float_linears: list[str], *,
                              symmetric: bool | None = None,
                              scale_dtype: torch.dtype = torch.float16) -> FormatTensors:
    """compressed-tensors ``pack-quantized`` (W4A16 / W8A16), group or channel, symmetric or
    not; scales in ``scale_dtype`` (llm-compressor stores them in the model's dtype)."""
    bits, group_size = _shared_layout(weights)
    sym = _symmetric(weights, bits, symmetric)
    packed: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        packed.update(_compressed_tensors_linear(_module(name), weight, sym, scale_dtype))
    scheme = {"num_bits": bits, "type": "int", "symmetric": sym, "group_size": group_size,
              "strategy": "channel" if group_size is None else "group", "dynamic": False}
    return FormatTensors(_compressed_tensors_config("pack-quantized", scheme, None, weights,
                                                    float_linears), packed)


def float_quantized_layout(weights: Mapping[str, Fp8Weight], float_linears: list[str]
                           ) -> FormatTensors:
    """compressed-tensors ``float-quantized`` as llm-compressor's FP8_DYNAMIC preset writes
    it: ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` [N, 1], in float32 (the scales the
    values were rounded with: readers multiply in the scale's dtype)."""
    stored: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        if not isinstance(weight, Fp8Weight):
            raise ValueError(f"{name}: integer and FP8 linears mixed; one config group is "
                             "written")
        module = _module(name)
        stored[f"{module}.weight"] = weight.weight.contiguous()
        stored[f"{module}.weight_scale"] = weight.scales[:, None].contiguous()
    return FormatTensors(_compressed_tensors_config(
        "float-quantized", FP8_DYNAMIC_WEIGHTS, FP8_DYNAMIC_INPUTS, weights, float_linears),
        stored)


def _compressed_tensors_config(fmt: str, scheme: dict[str, Any], inputs: dict[str, Any] | None,
                               weights: Mapping[str, object], float_linears: list[str]
                               ) -> dict[str, Any]:
    """config.json's quantization_config of one config group in format ``fmt``."""
    ignore = list(float_linears)
    if "lm_head" not in ignore and "lm_head.weight" not in weights:
        ignore.append("lm_head")  # tied: still a Linear to vLLM, so it must be named
    return {
        "quant_method": "compressed-tensors", "format": fmt,
        "quantization_status": "compressed", "version": COMPRESSED_TENSORS_VERSION,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                      "input_activations": inputs, "output_activations": None,
                                      "format": fmt}},
        "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
        "sparsity_config": {}, "transform_config": {},
    }


def gptq_layout(weights: Mapping[str, IntWeight], float_linears: list[str], *,
                symmetric: bool | None = None, desc_act: bool | None = None,
                checkpoint_format: str = "gptq") -> FormatTensors:
    """GPTQ, 4 or 8 bits, a group size or -1 (one group a row). Act-order weights (``perm``)
    are written with their ``g_idx`` and ``desc_act: true`` (None: act-order when any weight
    is). ``checkpoint_format`` "gptq" (v1, zero - 1 stored: what vLLM reads) or "gptq_v2"."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} (gptq, gptq_v2)")
    bits, group_size = _shared_layout(weights)
    sym = _symmetric(weights, bits, symmetric)
    act = any(w.perm is not None for w in weights.values())
    if desc_act is False and act:
        raise ValueError("act-order weights (perm) need desc_act")
    if skipped := [m for m in float_linears if m != "lm_head"]:
        raise ValueError(f"GPTQ quantizes every linear of the decoder layers; {skipped[0]} "
                         "is not quantized")
    offset = 1 if checkpoint_format == "gptq" else 0
    packed: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        packed.update(_gptq_linear(_module(name), weight, offset))
    config = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size or -1,
        "desc_act": bool(desc_act or act), "sym": sym, "lm_head": "lm_head.weight" in weights,
        "checkpoint_format": checkpoint_format, "format": checkpoint_format,
        "static_groups": False, "meta": {"quantizer": ["tidegate"]},
    }
    return FormatTensors(config, packed)


def awq_layout(weights: Mapping[str, IntWeight], float_linears: list[str], *,
               symmetric: bool | None = None) -> FormatTensors:
    """AutoAWQ's GEMM layout, 4 bits in groups. Symmetric weights are written with
    ``zero_point: false`` and their zeros (8) still stored, since vLLM reads qzeros always."""
    bits, group_size = _shared_layout(weights)
    if bits != 4 or group_size is None:
        raise ValueError("AWQ GEMM stores 4-bit weights in groups (vLLM needs a group size)")
    if "lm_head.weight" in weights:
        raise ValueError("AWQ checkpoints keep lm_head in float")
    sym = _symmetric(weights, bits, symmetric)
    packed: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        packed.update(_awq_linear(_module(name), weight))
    skipped = [m for m in float_linears if m != "lm_head"]
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": not sym,
              "version": "gemm", "modules_to_not_convert": skipped or None}
    return FormatTensors(config, packed)


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit integers [R, C] -> int32 words packed along ``dim``: element j goes
    to field j % p (bits (j % p) * bits and up) of word j // p, p = 32 / bits; a short last word
    is padded with zeros."""
    if dim == 0:
        return pack_words(values.t(), bits, 1).t().contiguous()
    per_word = 32 // bits
    v = values.to(torch.int64)
    v = F.pad(v, (0, -v.shape[1] % per_word)).view(v.shape[0], -1, per_word)
    words = (v << torch.arange(0, 32, bits, dtype=torch.int64)).sum(dim=2)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _compressed_tensors_linear(module: str, weight: IntWeight, symmetric: bool,
                               scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if weight.perm is not None:
        raise ValueError(f"{module}: compressed-tensors 0.20 stores no act-order column order; "
                         "write act-order weights as GPTQ")
    n, k = weight.shape
    out = {f"{module}.weight_packed": pack_words(weight.ints(), weight.bits, dim=1),
           f"{module}.weight_scale": _scales(module, weight, scale_dtype),
           f"{module}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:  # unsigned zeros = signed + 2**(bits-1), packed along N
        out[f"{module}.weight_zero_point"] = pack_words(weight.zeros, weight.bits, dim=0)
    return out


def _gptq_linear(module: str, weight: IntWeight, zero_offset: int) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    q, g_idx = weight.ints(), torch.arange(k, dtype=torch.int32) // weight.group_size
    if weight.perm is not None:  # back to input column order; g_idx says each one's group
        q, g_idx = torch.empty_like(q), torch.empty_like(g_idx)
        q[:, weight.perm] = weight.ints()
        g_idx[weight.perm] = torch.arange(k, dtype=torch.int32) // weight.group_size
    zeros = weight.zeros.to(torch.int32) - zero_offset
    if int(zeros.min()) < 0:
        raise ValueError(f"{module}: GPTQ v1 stores zero - 1, so a zero point of 0 cannot be "
                         "written (checkpoint_format='gptq_v2' or compressed-tensors can)")
    return {f"{module}.qweight": pack_words(q.t(), weight.bits, dim=0),  # [K/p, N]
            f"{module}.qzeros": pack_words(zeros.t(), weight.bits, dim=1),  # [K/G, N/p]
            f"{module}.scales": _scales(module, weight, torch.float16).t().contiguous(),
            f"{module}.g_idx": g_idx}


def _awq_linear(module: str, weight: IntWeight) -> dict[str, torch.Tensor]:
    if weight.perm is not None:
        raise ValueError(f"{module}: AWQ has no act-order; write act-order weights as GPTQ")

    def interleave(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N] in field order
        rows, cols = values.shape
        return values.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, cols)

    if weight.shape[0] % 8:
        raise ValueError(f"{module}: AWQ packs 8 output columns a word; {weight.shape[0]} rows")
    return {f"{module}.qweight": pack_words(interleave(weight.ints().t()), 4, dim=1),
            f"{module}.qzeros": pack_words(interleave(weight.zeros.t().to(torch.int32)), 4, 1),
            f"{module}.scales": _scales(module, weight, torch.float16).t().contiguous()}


def _scales(module: str, weight: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    scales = weight.scales.to(dtype)
    if not torch.isfinite(scales).all():
        raise ValueError(f"{module}: scales overflow {dtype}")
    return scales


def _shared_layout(quantized: Mapping[str, IntWeight]) -> tuple[int, int | None]:
    """(bits, group size) that every weight shares; group size None: one group per row."""
    if not quantized:
        raise ValueError("no quantized linears to write")
    bits = {w.bits for w in quantized.values()}
    if len(bits) > 1:
        raise ValueError(f"linears differ in bits ({sorted(bits)}); one config group is written")
    if all(w.group_size == w.shape[1] for w in quantized.values()):
        return bits.pop(), None
    sizes = {w.group_size for w in quantized.values()}
    if len(sizes) > 1:
        raise ValueError(f"linears differ in group size ({sorted(sizes)})")
    return bits.pop(), sizes.pop()


def _symmetric(quantized: Mapping[str, IntWeight], bits: int, symmetric: bool | None) -> bool:
    mid = 1 << (bits - 1)
    off = next((name for name, w in quantized.items() if not torch.all(w.zeros == mid)), None)
    if symmetric and off is not None:
        raise ValueError(f"{off}: symmetric weights have every zero point at {mid}")
    return off is None if symmetric is None else symmetric


def _module(hf_name: str) -> str:
    if not is_linear(hf_name):
        raise ValueError(f"{hf_name}: only linears (*_proj.weight, lm_head.weight) are written "
                         "as integers")
    return hf_name.removesuffix(".weight")


def is_linear(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"
