"""Mixtral: Mistral's attention, every MLP replaced by 8 experts of which each token takes 2
(softmax over all, renormalized over the two)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import TensorNames
from tidegate.worker.models.families.family import Family
from tidegate.worker.models.families.hf_config import (
    check_activation,
    require,
    rope_fields,
    shape_fields,
)


def mixtral_config(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    shape = shape_fields(hf, where)
    theta, scaling = rope_fields(hf, where, default_theta=1_000_000.0)
    window = hf.get("sliding_window")
    return ModelConfig(**shape, rope_theta=theta, rope_scaling=scaling,
                       hidden_act=check_activation(hf, where, "hidden_act"),
                       sliding_window=int(window) if window else None,
                       num_experts=int(require(hf, "num_local_experts", where)),
                       experts_per_token=int(require(hf, "num_experts_per_tok", where)),
                       moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=True,
                       family="mixtral")


FAMILY = Family("mixtral", ("mixtral",), mixtral_config, TensorNames(
    router="block_sparse_moe.gate",
    expert=("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
            "block_sparse_moe.experts.{e}.w2")))
