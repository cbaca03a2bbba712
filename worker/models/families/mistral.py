"""Mistral: Llama's layer, with a sliding window on every layer where the config sets one
(Mistral 7B v0.1: 4096 tokens; later versions none)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import check_activation, rope_fields, shape_fields


def mistral_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    theta, scaling = rope_fields(hf, where)
    window = hf.get("sliding_window")
    return ModelConfig(**shape_fields(hf, where), rope_theta=theta, rope_scaling=scaling,
                       hidden_act=check_activation(hf, where, "hidden_act"),
                       sliding_window=int(window) if window else None, family="mistral")


FAMILY = Family("mistral", ("mistral",), mistral_config)
