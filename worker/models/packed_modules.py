"""Model parts whose weights stay packed: a projection (``PackedLinear``) over GGUF blocks
(``tidegate.kernels.weights.packed_weight``), integers with group scales (``tidegate.kernels.weights.int_weight``: GPTQ, AWQ,
compressed-tensors) or FP8 values scaled per row (``tidegate.kernels.weights.fp8_weight``), and an embedding
table (``PackedEmbedding``) in GGUF block formats.

They stand in for ``nn.Linear`` / ``nn.Embedding`` in a model whose file is quantized: the model
calls ``ops.linear(x, module.weight)`` and ``module(ids)`` either way, and the kernels read the
blocks directly. The weight is a plain attribute, not a parameter: it is never trained, cast or
moved by ``Module.to``. ``use_activations`` sets what the CPU multiplies them with
(``tidegate.kernels.reference.q8_activations``: float32 or 8-bit activations).
"""

from __future__ import annotations

import torch
from torch import nn

from tidegate.kernels import ops
from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.kernels.weights.packed_weight import PackedWeight

# Every matrix a PackedLinear may hold.
PackedMatrix = PackedWeight | IntWeight | Fp8Weight


class PackedLinear(nn.Module):
    """``x @ weight.T`` over a packed [out_features, in_features] matrix."""

    def __init__(self, weight: PackedMatrix) -> None:
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.register_parameter("bias", None)  # a float bias, where the model has one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.linear(x, self.weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {'+'.join(self.weight.types)}"


class PackedEmbedding(nn.Module):
    """Rows of a packed [num_embeddings, dim] table, each dequantized when looked up."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {'+'.join(self.weight.types)}"


def use_activations(model: nn.Module, activations: str) -> None:
    """Every packed matrix of ``model`` multiplies ``activations`` ("float" or "int8") on the
    CPU from now on (a tied LM head is its embedding's matrix: it follows), GGUF blocks in the
    layout the CPU's 8-bit kernels read fastest (``ops.cpu_layout``)."""
    for module in model.modules():
        if isinstance(module, PackedLinear | PackedEmbedding):
            weight = module.weight.with_activations(activations)
            if isinstance(weight, PackedWeight) and activations == "int8":
                weight = ops.cpu_layout(weight)
            module.weight = weight
