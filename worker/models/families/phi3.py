"""Phi-3 (mini, small-context and LongRoPE variants): Llama's layer stored with q/k/v and
gate/up already fused, a sliding window on every layer where the config sets one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import TensorNames
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import check_activation, rope_fields, shape_fields


def phi3_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    theta, scaling = rope_fields(hf, where)
    window = hf.get("sliding_window")
    return ModelConfig(**shape_fields(hf, where), rope_theta=theta, rope_scaling=scaling,
                       hidden_act=check_activation(hf, where, "hidden_act"),
                       sliding_window=int(window) if window else None, family="phi3")


FAMILY = Family("phi3", ("phi3",), phi3_config,
                TensorNames(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)))
