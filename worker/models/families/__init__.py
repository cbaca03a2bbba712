"""The model families tidegate loads, one file each, found by config.json's ``model_type``.

``tidegate.model_files.model_source.HF_MODEL_TYPES`` (which the API checks without importing
torch) lists the same types; a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.models.families import (
    gemma,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from tidegate.worker.models.families.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, phi3.FAMILY, gemma.GEMMA2,
    gemma.GEMMA3, mixtral.FAMILY, qwen3_moe.FAMILY,
)
_BY_TYPE = {t: family for family in FAMILIES for t in family.model_types}
MODEL_TYPES = frozenset(_BY_TYPE)


def family_of(hf: Mapping[str, Any], where: Path) -> Family:
    """The family of a config.json; ``ModelLoadError`` naming the type when none loads it."""
    model_type = hf.get("model_type")
    if model_type not in _BY_TYPE and "LlamaForCausalLM" in (hf.get("architectures") or []):
        model_type = "llama"
    if model_type not in _BY_TYPE:
        raise ModelLoadError(f"{where}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted(_BY_TYPE))})")
    return _BY_TYPE[model_type]


__all__ = ["FAMILIES", "MODEL_TYPES", "Family", "family_of"]
