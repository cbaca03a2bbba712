"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before the rotary."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import check_activation, rope_fields, shape_fields
from tidegate.worker.models.families.qwen2 import qwen_window


def qwen3_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    shape = shape_fields(hf, where)
    theta, scaling = rope_fields(hf, where)
    window, kinds = qwen_window(hf, shape["num_layers"], where)
    bias = bool(hf.get("attention_bias"))
    return ModelConfig(**shape, rope_theta=theta, rope_scaling=scaling, qk_norm=True,
                       qkv_bias=bias, o_bias=bias,
                       hidden_act=check_activation(hf, where, "hidden_act"),
                       sliding_window=window, layer_kinds=kinds, family="qwen3")


FAMILY = Family("qwen3", ("qwen3",), qwen3_config)
