"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, routed experts (128, 8 per token)
on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse, a dense MLP on the
others."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import (
    check_activation,
    require,
    rope_fields,
    shape_fields,
)
from tidegate.worker.models.families.qwen2 import qwen_window


def qwen3_moe_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    shape = shape_fields(hf, where)
    n = shape["num_layers"]
    theta, scaling = rope_fields(hf, where)
    window, kinds = qwen_window(hf, n, where)
    if hf.get("shared_expert_intermediate_size"):
        raise ModelLoadError(f"{where}: shared experts are not supported")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    bias = bool(hf.get("attention_bias"))
    return ModelConfig(**shape, rope_theta=theta, rope_scaling=scaling, qk_norm=True,
                       qkv_bias=bias, o_bias=bias,
                       hidden_act=check_activation(hf, where, "hidden_act"),
                       sliding_window=window, layer_kinds=kinds,
                       num_experts=int(hf.get("num_experts")
                                       or require(hf, "num_local_experts", where)),
                       experts_per_token=int(require(hf, "num_experts_per_tok", where)),
                       moe_intermediate_size=int(require(hf, "moe_intermediate_size", where)),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       moe_layers=None if all(sparse) else sparse, family="qwen3_moe")


FAMILY = Family("qwen3_moe", ("qwen3_moe",), qwen3_moe_config)
