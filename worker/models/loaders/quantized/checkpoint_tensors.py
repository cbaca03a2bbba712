"""What every quantized-checkpoint format shares: a checkpoint's raw tensors fetched with their
dtype and shape checked (``CheckpointTensors``), the ``CheckpointFormat`` a format's reader
implements, the Llama linears and their shapes, and the unpacking of int32 words, act-order and
group checks the formats have in common."""

from __future__ import annotations

from typing import Protocol

import torch

from tidegate.kernels.weights.fp8_weight import Fp8Weight
from tidegate.kernels.weights.int_weight import IntWeight
from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import layer_matrices
from tidegate.worker.models.loaders.hf_weights import SafetensorsWeights

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64)


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every linear's HF weight name -> its (out N, in K) shape."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    by_part = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
               "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    shapes = {name: by_part[name.split(".")[-2]] for layer in range(config.num_layers)
              for _, _, names in layer_matrices(layer) for name in names}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


class CheckpointTensors:
    """A checkpoint's raw tensors, each fetched with its dtype and shape checked."""

    def __init__(self, raw: SafetensorsWeights, fmt: str) -> None:
        self.raw, self.fmt = raw, fmt

    def has(self, name: str) -> bool:
        return name in self.raw

    def get(self, name: str, dtypes: tuple[torch.dtype, ...],
            *shapes: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name``, which must have one of ``dtypes`` and one of ``shapes``."""
        where = f"{self.raw.path}: tensor {name} ({self.fmt})"
        if name not in self.raw:
            raise ModelLoadError(f"{where} is missing")
        tensor = self.raw[name]
        if tensor.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ModelLoadError(f"{where} is {str(tensor.dtype).removeprefix('torch.')}, "
                                 f"expected {allowed}")
        if tuple(tensor.shape) not in shapes:
            expected = " or ".join(str(list(s)) for s in shapes)
            raise ModelLoadError(f"{where} has shape {list(tensor.shape)}, expected {expected}")
        return tensor


class CheckpointFormat(Protocol):
    name: str
    owned: tuple[str, ...]  # suffixes of a quantized module's tensors that the format reads
    markers: tuple[str, ...]  # suffixes that only a quantized module has

    def quantized(self, module: str, tensors: CheckpointTensors) -> bool: ...

    def read(self, module: str, shape: tuple[int, int], tensors: CheckpointTensors
             ) -> IntWeight | Fp8Weight: ...


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words [R, C] -> their ``bits``-bit fields as int32, unpacked along ``dim``: field i of
    a word (bits i*bits and up) is element ``word_index * 32 / bits + i``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    w = words.to(torch.int32)
    if dim == 0:  # [R, p, C]
        return ((w.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(-1, w.shape[1])
    return ((w.unsqueeze(2) >> shifts) & mask).reshape(w.shape[0], -1)  # [R, C, p]


def act_order(g_idx: torch.Tensor, group_size: int, where: str) -> torch.Tensor | None:
    """The stored column order for ``g_idx`` [K] (the group of each input column): None when
    groups are already runs of ``group_size``, else the stable sort of ``g_idx``."""
    groups = torch.arange(g_idx.numel()) // group_size
    g = g_idx.to(torch.int64)
    if torch.equal(g, groups):
        return None
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], groups):
        raise ModelLoadError(f"{where} does not put {group_size} columns in each group")
    return perm


def check_divides(where: str, shape: tuple[int, int], group: int, per_word: int) -> None:
    n, k = shape
    if k % group or k % per_word or n % per_word:
        raise ModelLoadError(f"{where}: a [{n}, {k}] matrix does not split into groups of "
                             f"{group} columns and words of {per_word} values")
