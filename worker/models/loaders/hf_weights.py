"""Weights from a Hugging Face model directory: config.json (read by the model's family,
``tidegate.worker.models.families``) and *.safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tidegate.model_files.model_source import ModelLoadError, hf_config
from tidegate.worker.models.config import ModelConfig
from tidegate.worker.models.families import Family, family_of


def hf_model_config(model_dir: Path) -> tuple[Family, ModelConfig]:
    """The family and ``ModelConfig`` of config.json; refuses what tidegate does not implement,
    naming the file and the field."""
    cfg = hf_config(model_dir)
    where = model_dir / "config.json"
    family = family_of(cfg, where)
    try:
        return family, family.config(cfg, where)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of every *.safetensors shard in a directory, each read when looked up."""

    def __init__(self, model_dir: Path) -> None:
        self.path = model_dir
        self.family, self.config = hf_model_config(model_dir)
        self.sources = self.family.tensor_sources(self.config)
        self._files: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(f"model directory {model_dir} has no *.safetensors weights")
        for shard in shards:
            try:
                with safe_open(shard, framework="pt") as f:
                    self._files.update(dict.fromkeys(f.keys(), shard))
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{shard}: cannot read safetensors: {exc}") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        # One open handle per shard: opening a shard costs ~4 ms, and a quantized checkpoint
        # reads ~900 tensors (3.8 s of its load when each lookup opened the file again).
        shard = self._files[name]
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(shard, framework="pt")
        return handle.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (dequantize) the tensor just to answer.
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
