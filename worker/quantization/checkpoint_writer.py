"""Write a Hugging Face Llama directory whose linears are quantized: config.json with the
format's ``quantization_config``, one model.safetensors (the quantized linears in the format's
layout and every other tensor as given) and the tokenizer files.

The values come as one ``IntWeight`` (integers) or ``Fp8Weight`` (e4m3) per linear, keyed by its
HF weight name, so the writer does not care how they were computed; ``checkpoint_layouts`` lays
them out in the chosen format: compressed-tensors (``pack-quantized`` for integers, what
``tidegate quantize`` writes, and ``float-quantized`` for FP8), GPTQ or AWQ GEMM.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.quantization.checkpoint_layouts import (
    awq_layout,
    compressed_tensors_layout,
    float_quantized_layout,
    gptq_layout,
    is_linear,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
EMBEDDING = "model.embed_tokens.weight"


class SavesTokenizer(Protocol):
    def save(self, model_dir: Path) -> None: ...


def write_checkpoint(path: Path, config: ModelConfig | Mapping[str, Any],
                     tensors: Mapping[str, torch.Tensor],
                     weights: Mapping[str, IntWeight | Fp8Weight],
                     tokenizer: SavesTokenizer | Path | None = None, *,
                     format: str = "compressed-tensors", symmetric: bool | None = None,
                     desc_act: bool | None = None, gptq_format: str = "gptq",
                     scale_dtype: torch.dtype | None = None) -> int:
    """Write the model directory ``path``; returns the bytes written.

    ``config``: the model's ``ModelConfig`` (config.json is built from it) or an HF config.json
    dict (written as is, plus the quantization_config). ``tensors``: HF-named float tensors,
    read lazily; those of quantized linears are skipped. ``weights``: the integers (or FP8
    values: compressed-tensors only) of each quantized linear, by HF weight name.
    ``tokenizer``: saved (``Tokenizer.save``) or, a directory, its tokenizer files copied.
    ``format``: compressed-tensors, gptq or awq; ``symmetric`` None: symmetric when every zero
    is the midpoint. The other options are one format's (``compressed_tensors_layout``,
    ``gptq_layout``)."""
    float_dtype = tensors[EMBEDDING].dtype if EMBEDDING in tensors else torch.float32
    hf = dict(config) if isinstance(config, Mapping) else hf_config_json(config, float_dtype)
    tied = bool(hf.get("tie_word_embeddings", False))
    floats = [n for n in tensors if n not in weights and not (tied and n == "lm_head.weight")]
    float_linears = [n.removesuffix(".weight") for n in floats if is_linear(n)]
    if any(isinstance(w, Fp8Weight) for w in weights.values()):
        if format != "compressed-tensors":
            raise ValueError(f"checkpoint format {format!r} holds integers; FP8 weights are "
                             "written compressed-tensors (float-quantized)")
        if symmetric is False or scale_dtype not in (None, torch.float32):
            raise ValueError("FP8 weights are symmetric, with the float32 scales they were "
                             "rounded with")
        layout = float_quantized_layout(weights, float_linears)  # type: ignore[arg-type]
    elif format == "compressed-tensors":
        layout = compressed_tensors_layout(weights, float_linears,  # type: ignore[arg-type]
                                           symmetric=symmetric,
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


def hf_config_json(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
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
