"""Reading the fields every family's config.json shares: the shape, the rotary, the window.

transformers 5 writes rotary settings under ``rope_parameters`` (per layer type for Gemma 3);
older configs keep ``rope_theta`` and ``rope_scaling`` at the top level. Both are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.kernels.reference.rotary import ROPE_TYPES, Llama3Scaling, RopeScaling, Scaling
from tidegate.model_files.model_source import ModelLoadError


def require(hf: Mapping[str, Any], key: str, where: Path) -> Any:
    if key not in hf or hf[key] is None:
        raise ModelLoadError(f"{where}: missing {key!r}")
    return hf[key]


def shape_fields(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of the shape every family has (rope aside)."""
    heads = int(require(hf, "num_attention_heads", where))
    hidden = int(require(hf, "hidden_size", where))
    factor = float(hf.get("partial_rotary_factor")
                   or (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
    if factor != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor {factor} is not supported "
                             "(rotary over the whole head only)")
    return dict(
        vocab_size=int(require(hf, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_layers=int(require(hf, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def rope_fields(hf: Mapping[str, Any], where: Path, layer_type: str | None = None,
                default_theta: float = 10_000.0) -> tuple[float, Scaling | None]:
    """(theta, scaling) of the rotary; ``layer_type``: the entry of a per-layer-type
    ``rope_parameters`` (Gemma 3)."""
    params: Mapping[str, Any] = hf.get("rope_parameters") or {}
    per_type = layer_type is not None and isinstance(params.get(layer_type), Mapping)
    if per_type:
        params = params[layer_type]  # type: ignore[index]
    elif layer_type is not None:
        params = {}
    scaling = params if params.get("rope_type") else (hf.get("rope_scaling") or params)
    if layer_type == "sliding_attention" and not per_type:
        scaling = {}  # a top-level rope_scaling is the global layers' (Gemma 3)
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or default_theta)
    return theta, rope_scaling(scaling or {}, hf, where)


def rope_scaling(rope: Mapping[str, Any], hf: Mapping[str, Any], where: Path) -> Scaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "su":  # Phi-3's first name for LongRoPE
        kind = "longrope"
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope_type {kind!r} is not supported "
                             f"({', '.join(ROPE_TYPES)})")
    max_pos = int(hf.get("max_position_embeddings", 2048))
    original = int(rope.get("original_max_position_embeddings")
                   or hf.get("original_max_position_embeddings") or max_pos)
    try:
        if kind == "llama3":
            return Llama3Scaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                 float(rope["high_freq_factor"]), original)
        factor = rope.get("factor")
        if kind in ("yarn", "longrope") and factor is None:
            factor = max_pos / original
        return RopeScaling(
            kind, float(factor if factor is not None else 1.0), original,
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            attention_factor=(None if rope.get("attention_factor") is None
                              else float(rope["attention_factor"])),
            mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
            truncate=bool(rope.get("truncate", True)),
            short_factor=tuple(float(x) for x in rope.get("short_factor") or ()),
            long_factor=tuple(float(x) for x in rope.get("long_factor") or ()),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: rope_type {kind!r}: {exc}") from exc


def layer_kinds(hf: Mapping[str, Any], num_layers: int, where: Path,
                default: list[str] | None = None) -> tuple[str, ...] | None:
    """Each layer's attention kind ("full" or "sliding") from ``layer_types``, else
    ``default``; None when every layer is the same."""
    types = hf.get("layer_types") or default
    if not types:
        return None
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if len(types) != num_layers or any(t not in names for t in types):
        raise ModelLoadError(f"{where}: layer_types {types!r}: need {num_layers} entries of "
                             f"{', '.join(names)}")
    return tuple(names[t] for t in types)


def check_activation(hf: Mapping[str, Any], where: Path, *keys: str) -> str:
    """The MLP's activation under its config keys, as ``ModelConfig`` names it."""
    act = next((hf[k] for k in keys if hf.get(k)), "silu")
    known = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
             "gelu_tanh": "gelu_tanh"}
    if act not in known:
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported "
                             f"({', '.join(known)})")
    return known[act]
