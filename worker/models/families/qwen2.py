"""Qwen2 and Qwen2.5: Llama's layer with biases on q, k and v."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import (
    check_activation,
    layer_kinds,
    rope_fields,
    shape_fields,
)


def qwen_window(hf: Mapping[str, Any], num_layers: int, where: Path
                ) -> tuple[int | None, tuple[str, ...] | None]:
    """Qwen's optional sliding window: off unless ``use_sliding_window``; the layers from
    ``max_window_layers`` on slide (transformers 5 writes them as ``layer_types``)."""
    if not hf.get("use_sliding_window") or not hf.get("sliding_window"):
        return None, None
    first = int(hf.get("max_window_layers", num_layers))
    default = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    return int(hf["sliding_window"]), layer_kinds(hf, num_layers, where, default)


def qwen2_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    shape = shape_fields(hf, where)
    theta, scaling = rope_fields(hf, where)
    window, kinds = qwen_window(hf, shape["num_layers"], where)
    return ModelConfig(**shape, rope_theta=theta, rope_scaling=scaling, qkv_bias=True,
                       hidden_act=check_activation(hf, where, "hidden_act"),
                       sliding_window=window, layer_kinds=kinds, family="qwen2")


FAMILY = Family("qwen2", ("qwen2",), qwen2_config)
