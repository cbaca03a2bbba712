"""``Family``: what the loaders need to know of one model family, and nothing the engine reads.

A family turns its config.json into a ``ModelConfig`` and spells its checkpoint's tensor names
(``TensorNames``); the decoder does the rest. Its file lives beside this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.decoder import TensorNames, TensorSource, hf_tensor_sources


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values it loads
    config: Callable[[Mapping[str, Any], Path], ModelConfig]  # (config.json, its path)
    names: TensorNames = field(default_factory=TensorNames)

    def tensor_sources(self, cfg: ModelConfig) -> list[TensorSource]:
        return hf_tensor_sources(cfg, self.names)
