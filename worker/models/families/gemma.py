"""Gemma 2 and Gemma 3 (text): GeGLU, norms before and after attention and the MLP, norm gains
stored minus one, the embedding scaled by sqrt(hidden), local sliding-window layers between
global ones; Gemma 2 soft-caps attention scores and final logits, Gemma 3 norms q and k per head
and rotates its local layers with their own base."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import TensorNames
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import (
    check_activation,
    layer_kinds,
    require,
    rope_fields,
    shape_fields,
)


def _common(hf: Mapping[str, Any], where: Path, every: int) -> dict[str, Any]:
    shape = shape_fields(hf, where)
    n = shape["num_layers"]
    # Configs without layer_types: every ``every``-th layer global, the rest local.
    default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    hidden = shape["hidden_size"]
    scalar = float(hf.get("query_pre_attn_scalar") or shape["head_dim"])
    shape["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    return dict(
        **shape, hidden_act=check_activation(hf, where, "hidden_activation", "hidden_act"),
        sandwich_norms=True, embed_scale=math.sqrt(hidden), attn_scale=scalar ** -0.5,
        sliding_window=int(require(hf, "sliding_window", where)),
        layer_kinds=layer_kinds(hf, n, where, default),
    )


def gemma2_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    theta, scaling = rope_fields(hf, where)
    final, attn = hf.get("final_logit_softcapping"), hf.get("attn_logit_softcapping")
    return ModelConfig(**_common(hf, where, 2), rope_theta=theta, rope_scaling=scaling,
                       final_softcap=float(final) if final else None,
                       attn_softcap=float(attn) if attn else None, family="gemma2")


def gemma3_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    theta, scaling = rope_fields(hf, where, "full_attention", 1_000_000.0)
    local_theta, local_scaling = rope_fields(hf, where, "sliding_attention", 10_000.0)
    if "rope_local_base_freq" in hf:
        local_theta = float(hf["rope_local_base_freq"])
    final, attn = hf.get("final_logit_softcapping"), hf.get("attn_logit_softcapping")
    return ModelConfig(**_common(hf, where, every), rope_theta=theta, rope_scaling=scaling,
                       local_rope_theta=local_theta, local_rope_scaling=local_scaling,
                       qk_norm=True, final_softcap=float(final) if final else None,
                       attn_softcap=float(attn) if attn else None, family="gemma3")


_NAMES = TensorNames(pre_mlp_norm="pre_feedforward_layernorm",
                     attn_out_norm="post_attention_layernorm",
                     mlp_out_norm="post_feedforward_layernorm", norm_offset=1.0)
GEMMA2 = Family("gemma2", ("gemma2",), gemma2_config, _NAMES)
GEMMA3 = Family("gemma3", ("gemma3_text",), gemma3_config, _NAMES)
