"""Llama weights from a Hugging Face model directory: config.json and *.safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kernels.rotary import Llama3Scaling
from tidegate.model_files.model_source import ModelLoadError, hf_config
from worker.models.llama import LlamaConfig


def hf_llama_config(model_dir: Path) -> LlamaConfig:
    """``LlamaConfig`` from config.json; refuses what our model does not implement."""
    cfg = hf_config(model_dir)
    where = model_dir / "config.json"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelLoadError(f"{where}: {flag}=true is not supported")
    heads = int(cfg["num_attention_heads"])
    # transformers 5 writes rope settings under rope_parameters; older configs use rope_theta
    # and rope_scaling at the top level.
    rope: dict[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    try:
        return LlamaConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10_000.0))),
            rope_scaling=_rope_scaling(rope, where),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: missing {exc.args[0]!r}") from exc


def _rope_scaling(rope: Mapping[str, Any], where: Path) -> Llama3Scaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{where}: rope_type {kind!r} is not supported (default, llama3)")
    return Llama3Scaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of every *.safetensors shard in a directory, each read when looked up."""

    def __init__(self, model_dir: Path) -> None:
        self.path = model_dir
        self.config = hf_llama_config(model_dir)
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
