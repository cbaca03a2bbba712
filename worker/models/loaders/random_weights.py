"""Random weights of a real model's shape, for benchmarks and tests without a checkpoint."""

from __future__ import annotations

import math

import torch

from tidegate.kernels.reference.rotary import Llama3Scaling
from tidegate.model_files.model_source import preset_config
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import DecoderModel

INIT_STD = 0.02


def preset_llama_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a random preset (``tidegate.model_files.model_source.RANDOM_PRESETS``)."""
    fields = preset_config(name)
    scaling = fields.pop("rope_scaling")
    return ModelConfig(**fields, rope_scaling=Llama3Scaling(**scaling) if scaling else None)


@torch.no_grad()
def init_random_weights(model: DecoderModel, seed: int) -> None:
    """Fill the model in place: normal(0, 0.02) matrices, norms of one.

    The projections that write into the residual stream (o_proj, down_proj) get the std divided
    by sqrt(2 * layers), as GPT-2 does, so hidden states stay near unit scale through deep stacks
    and logits stay finite in bfloat16. Values are drawn on the model's device in its dtype, so
    the same seed gives the same weights only on the same kind of device.
    """
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * model.cfg.num_layers)
    for name, param in model.named_parameters():
        if param.dim() == 1:  # RMSNorm gains, biases
            param.fill_(0.0 if name.endswith(".bias") else 1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
            param.normal_(0.0, residual_std, generator=generator)
        else:
            param.normal_(0.0, INIT_STD, generator=generator)
