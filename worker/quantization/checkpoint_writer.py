"""Write a Hugging Face Llama directory whose linears are integers: config.json with the format's
``quantization_config``, one model.safetensors (the quantized linears in the format's layout and
every other tensor as given) and the tokenizer files.

The integers come as one ``IntWeight`` per linear, keyed by its HF weight name, so the writer does
not care how they were computed. Three layouts, each what its other readers (transformers, vLLM)
load: compressed-tensors ``pack-quantized`` (what ``tidegate quantize`` writes), GPTQ (v1 by
default; act-order through ``g_idx``) and AWQ GEMM. The packing conventions are the ones
``worker/models/loaders/quantized/`` reads, written out here in the other direction.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kernels.int_weight import IntWeight
from worker.models.llama import LlamaConfig

# AutoAWQ packs output column 8c + AWQ_ORDER[i] into field i of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The layout of compressed-tensors this writes (its config's "version").
COMPRESSED_TENSORS_VERSION = "0.20.0"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
EMBEDDING = "model.embed_tokens.weight"


class SavesTokenizer(Protocol):
    def save(self, model_dir: Path) -> None: ...


@dataclass(frozen=True, slots=True)
class FormatTensors:
    """A format's share of a checkpoint."""

    quantization_config: dict[str, Any]  # config.json's entry
    tensors: dict[str, torch.Tensor]  # the quantized linears, under the format's tensor names


def write_checkpoint(path: Path, config: LlamaConfig | Mapping[str, Any],
                     tensors: Mapping[str, torch.Tensor], weights: Mapping[str, IntWeight],
                     tokenizer: SavesTokenizer | Path | None = None, *,
                     format: str = "compressed-tensors", symmetric: bool | None = None,
                     desc_act: bool | None = None, gptq_format: str = "gptq",
                     scale_dtype: torch.dtype | None = None) -> int:
    """Write the model directory ``path``; returns the bytes written.

    ``config``: the model's ``LlamaConfig`` (config.json is built from it) or an HF config.json
    dict (written as is, plus the quantization_config). ``tensors``: HF-named float tensors,
    read lazily; those of quantized linears are skipped. ``weights``: the integers of each
    quantized linear, by HF weight name. ``tokenizer``: saved (``Tokenizer.save``) or, a
    directory, its tokenizer files copied. ``format``: compressed-tensors, gptq or awq;
    ``symmetric`` None: symmetric when every zero is the midpoint. The other options are
    one format's (``compressed_tensors_layout``, ``gptq_layout``)."""
    float_dtype = tensors[EMBEDDING].dtype if EMBEDDING in tensors else torch.float32
    hf = dict(config) if isinstance(config, Mapping) else hf_config_json(config, float_dtype)
    tied = bool(hf.get("tie_word_embeddings", False))
    floats = [n for n in tensors if n not in weights and not (tied and n == "lm_head.weight")]
    float_linears = [n.removesuffix(".weight") for n in floats if _is_linear(n)]
    if format == "compressed-tensors":
        layout = compressed_tensors_layout(weights, float_linears, symmetric=symmetric,
                                           scale_dtype=scale_dtype or float_dtype)
    elif format == "gptq":
        layout = gptq_layout(weights, float_linears, symmetric=symmetric, desc_act=desc_act,
                             checkpoint_format=gptq_format)
    elif format == "awq":
        layout = awq_layout(weights, float_linears, symmetric=symmetric)
    else:
        raise ValueError(f"checkpoint format {format!r} (compressed-tensors, gptq, awq)")
    if clash := sorted(set(floats) & layout.tensors.keys()):
        raise ValueError(f"tensor {clash[0]} is both given and written for a quantized linear")
    path.mkdir(parents=True, exist_ok=True)
    out = {name: tensors[name].detach().contiguous() for name in floats}
    save_file({**out, **layout.tensors}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    hf["quantization_config"] = layout.quantization_config
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if isinstance(tokenizer, Path):
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copyfile(tokenizer / name, path / name)
    elif tokenizer is not None:
        tokenizer.save(path)
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


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
    ignore = list(float_linears)
    if "lm_head" not in ignore and "lm_head.weight" not in weights:
        ignore.append("lm_head")  # tied: still a Linear to vLLM, so it must be named
    config = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "version": COMPRESSED_TENSORS_VERSION,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                      "input_activations": None, "output_activations": None,
                                      "format": "pack-quantized"}},
        "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
        "sparsity_config": {}, "transform_config": {},
    }
    return FormatTensors(config, packed)


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


def hf_config_json(config: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``LlamaForCausalLM`` of ``config``'s shape (rope in the legacy
    rope_theta / rope_scaling keys, which transformers 4 and 5 and vLLM all read)."""
    scaling = config.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "rope_theta": config.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


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
    if not _is_linear(hf_name):
        raise ValueError(f"{hf_name}: only linears (*_proj.weight, lm_head.weight) are written "
                         "as integers")
    return hf_name.removesuffix(".weight")


def _is_linear(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"

