"""Llama (1, 2, 3, 3.1, 3.2) and the models built like it (SmolLM, TinyLlama): the plain layer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import check_activation, rope_fields, shape_fields


def llama_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    if hf.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
    theta, scaling = rope_fields(hf, where)
    bias = bool(hf.get("attention_bias"))
    return ModelConfig(**shape_fields(hf, where), rope_theta=theta, rope_scaling=scaling,
                       hidden_act=check_activation(hf, where, "hidden_act"), qkv_bias=bias,
                       o_bias=bias, family="llama")


FAMILY = Family("llama", ("llama",), llama_config)
