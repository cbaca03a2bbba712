"""LoRA adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

An adapter holds, for each (layer, projection) it targets, PEFT's ``lora_A`` [r, in] and
``lora_B`` [out, r]; its scale is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).
The projection's weight with the adapter merged is ``W + scale * B @ A``, as PEFT merges it.
``stack_adapters`` lays several adapters of one projection side by side for the batched kernel
(``tidegate.kernels.reference.lora``), ranks zero-padded to the largest. What PEFT can save but this does not
serve (DoRA, per-module ranks, trained biases, fully trained modules) is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tidegate.kernels.reference.lora import MAX_RANK, LoraStack
from tidegate.model_files.model_source import ModelLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.weight)?$")
# Options whose non-default values change what the adapter computes in ways not served here.
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none",
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    rank: int
    scale: float
    # (layer, projection) -> (A [r, in], B [out, r]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def delta(self, layer: int, projection: str) -> torch.Tensor | None:
        """What the adapter adds to a projection's weight ([out, in]); None if untargeted."""
        pair = self.weights.get((layer, projection))
        return None if pair is None else self.scale * pair[1] @ pair[0]


def load_lora_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    """The adapter in a PEFT directory; ``ModelLoadError`` naming what is wrong."""
    folder = Path(path)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise ModelLoadError(f"{folder}: no {needed.name} (a PEFT LoRA adapter directory "
                                 f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: not JSON ({exc})") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, neutral in _REFUSED.items():
        if config.get(key, neutral) not in (neutral, None, [], {}, False, "none"):
            raise ModelLoadError(f"{config_path}: {key}={config[key]!r} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ModelLoadError(f"{config_path}: r={rank!r}; ranks 1 to {MAX_RANK} are served")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        match = _KEY.match(key)
        if match is None:
            raise ModelLoadError(f"{weights_path}: tensor {key!r} is not a LoRA matrix of a "
                                 f"decoder layer's projection")
        layer, projection, half = int(match[1]), match[2], match[3]
        if projection not in PROJECTIONS:
            raise ModelLoadError(f"{weights_path}: {key!r} targets {projection!r}; served: "
                                 f"{', '.join(PROJECTIONS)}")
        halves.setdefault((layer, projection), {})[half] = tensor.float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, projection), pair in sorted(halves.items()):
        if pair.keys() != {"A", "B"}:
            raise ModelLoadError(f"{weights_path}: layer {layer} {projection} lacks lora_"
                                 f"{({'A', 'B'} - pair.keys()).pop()}")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ModelLoadError(f"{weights_path}: layer {layer} {projection}: A {tuple(a.shape)}"
                                 f" and B {tuple(b.shape)} are not of rank {rank}")
        weights[(layer, projection)] = (a, b)
    if not weights:
        raise ModelLoadError(f"{weights_path}: no LoRA matrices")
    return LoraAdapter(name or folder.name, rank, scale, weights)


def stack_adapters(adapters: Sequence[LoraAdapter], layer: int, projection: str,
                   in_features: int, out_features: int, *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> LoraStack:
    """One projection's adapters side by side (adapter i at index i), ranks zero-padded to the
    largest; an adapter that does not target the projection adds nothing (scale 0)."""
    rank = max(a.rank for a in adapters)
    a = torch.zeros(len(adapters), rank, in_features)
    b = torch.zeros(len(adapters), out_features, rank)
    scale = torch.zeros(len(adapters))
    for i, adapter in enumerate(adapters):
        pair = adapter.weights.get((layer, projection))
        if pair is None:
            continue
        if pair[0].shape[1] != in_features or pair[1].shape[0] != out_features:
            raise ValueError(f"adapter {adapter.name}: layer {layer} {projection} is "
                             f"{tuple(pair[1].shape[:1]) + tuple(pair[0].shape[1:])}, the "
                             f"model's is ({out_features}, {in_features})")
        a[i, :adapter.rank] = pair[0]
        b[i, :, :adapter.rank] = pair[1]
        scale[i] = adapter.scale
    return LoraStack(a.to(device, dtype), b.to(device, dtype), scale.to(device))
