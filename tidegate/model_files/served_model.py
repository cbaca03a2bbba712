"""The models a deployment serves: each a key-safe name, the spec its weights load from, the
other names requests may give it, its own engine options and its LoRA adapters.

``served_models(settings)`` reads them from ``models_file`` (TOML or JSON), else from
``models`` (``--model`` repeated, ``TIDEGATE_MODELS``), else serves ``model`` alone. The first is
the default: jobs that name no model run on it, and it also answers to ``tidegate``. API,
workers and the batch worker read the same list, so they agree on every name. Plain Python.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from tidegate.model_files.model_source import model_name
from tidegate.settings import Settings

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A name every deployment's default model answers to, whatever it is (OpenAI clients need one).
DEFAULT_ALIAS = "tidegate"
# The Settings fields a model may set for itself; the rest (Redis, ports, retention) are the
# process's.
ENGINE_FIELDS = frozenset({
    "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size",
    "speculative", "num_speculative_tokens", "speculative_max_batch", "kv_cache_gb", "kv_cache_memory_fraction",
    "kv_cache_dtype", "dtype", "quantize", "weights", "block_size", "prefix_caching",
    "cuda_graphs", "max_loras", "max_lora_rank"})
_MODEL_KEYS = frozenset({"name", "spec", "aliases", "engine", "loras"})


class ServedModelError(ValueError):
    """A models file or value that cannot be served; the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # key-safe (NAME_RE): lane streams and the adapter registry are named after it
    spec: str  # what resolve_model / load_model take: smollm2, a path, a Hub id, random:<p>
    aliases: tuple[str, ...] = ()  # other names a request may give, e.g. "meta-llama/Llama-3-8B"
    # Per-model overrides of the engine's Settings fields (ENGINE_FIELDS), validated.
    engine: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    loras: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # name -> dir

    def settings(self, base: Settings) -> Settings:
        """``base`` with this model's spec and engine options: what its worker runs with."""
        return Settings.model_validate({**base.model_dump(), **self.engine, "model": self.spec})


def served_models(settings: Settings) -> list[ServedModel]:
    """Every model these settings serve, the default first; ``ServedModelError`` on bad input
    (a file that cannot be read, an unknown engine option, two models sharing a name)."""
    if settings.models_file:
        models = _from_file(Path(settings.models_file), settings)
    elif settings.models:
        models = [_from_item(item) for item in settings.models]
    else:
        models = [_model(None, settings.model)]
    if settings.loras:
        first = models[0]
        added = _loras(_pairs(settings.loras, "--lora"), "--lora")
        clash = sorted(set(first.loras) & set(added))
        if clash:
            raise ServedModelError(f"--lora {clash[0]}: model {first.name!r} already has an "
                                   f"adapter of that name")
        models[0] = _model(first.name, first.spec, first.aliases, first.engine,
                           {**first.loras, **added})
    try:
        _check_unique(models)
    except ServedModelError as exc:
        where = f"{settings.models_file}: " if settings.models_file else ""
        raise ServedModelError(f"{where}{exc}") from None
    return models


def default_name(spec: str) -> str:
    """A model's name when none is given: its source's name, made key-safe (a Hub id's is its
    repository's name, found without a download)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", model_name(spec)).lstrip("._-")
    return name[:64] or "model"


def _model(name: str | None, spec: str, aliases: tuple[str, ...] = (),
           engine: Mapping[str, Any] | None = None,
           loras: Mapping[str, str] | None = None) -> ServedModel:
    spec = spec.strip()
    if not spec:
        raise ServedModelError("a model's spec is empty")
    name = default_name(spec) if name is None else name
    if not NAME_RE.match(name):
        raise ServedModelError(f"model name {name!r}: 1 to 64 letters, digits, '.', '_' or "
                               f"'-', starting with a letter or digit")
    return ServedModel(name, spec, aliases, MappingProxyType(dict(_engine(name, engine or {}))),
                       MappingProxyType(dict(loras or {})))


def _from_item(item: str) -> ServedModel:
    """``spec`` or ``name=spec`` (a spec may hold '=': only a key-safe name before it splits)."""
    head, sep, tail = item.partition("=")
    if sep and NAME_RE.match(head.strip()):
        return _model(head.strip(), tail)
    return _model(None, item)


def _from_file(path: Path, settings: Settings) -> list[ServedModel]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ServedModelError(f"cannot read the models file {path}: {exc}") from None
    try:
        data: Any = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise ServedModelError(f"{path}: not valid {kind}: {exc}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ServedModelError(f"{path}: expected a non-empty list of models (JSON: a list or "
                               f"{{\"models\": [...]}}; TOML: [[models]] tables)")
    return [_from_entry(entry, f"{path}: model {i + 1}") for i, entry in enumerate(entries)]


def _from_entry(entry: Any, where: str) -> ServedModel:
    if not isinstance(entry, dict):
        raise ServedModelError(f"{where}: expected a table {{name?, spec, aliases?, engine?, "
                               f"loras?}}")
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        raise ServedModelError(f"{where}: unknown key {unknown[0]!r} (known: "
                               f"{', '.join(sorted(_MODEL_KEYS))})")
    spec, name = entry.get("spec"), entry.get("name")
    if not isinstance(spec, str):
        raise ServedModelError(f"{where}: 'spec' (a string) is required")
    if name is not None and not isinstance(name, str):
        raise ServedModelError(f"{where}: 'name' must be a string")
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ServedModelError(f"{where}: 'aliases' must be a list of non-empty strings")
    engine, loras = entry.get("engine", {}), entry.get("loras", {})
    if not isinstance(engine, dict):
        raise ServedModelError(f"{where}: 'engine' must be a table of engine options")
    if not isinstance(loras, dict) or not all(isinstance(v, str) for v in loras.values()):
        raise ServedModelError(f"{where}: 'loras' must map adapter names to directories")
    try:
        return _model(name, spec, tuple(aliases), engine, _loras(loras, f"{where}: loras"))
    except ServedModelError as exc:
        raise ServedModelError(f"{where}: {exc}") from None


def _engine(name: str, engine: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(engine) - ENGINE_FIELDS)
    if unknown:
        raise ServedModelError(f"model {name!r}: unknown engine option {unknown[0]!r} (known: "
                               f"{', '.join(sorted(ENGINE_FIELDS))})")
    try:
        checked = Settings.model_validate({**Settings.model_construct().model_dump(), **engine})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ServedModelError(f"model {name!r}: engine option "
                               f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return {key: getattr(checked, key) for key in engine}


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path.strip():
            raise ServedModelError(f"{what} {item!r}: expected NAME=PATH")
        if name.strip() in out:
            raise ServedModelError(f"{what} {name.strip()!r} is given twice")
        out[name.strip()] = path.strip()
    return out


def _loras(loras: Mapping[str, str], what: str) -> dict[str, str]:
    for name, path in loras.items():
        if not NAME_RE.match(name):
            raise ServedModelError(f"{what}: adapter name {name!r}: 1 to 64 letters, digits, "
                                   f"'.', '_' or '-', starting with a letter or digit")
        if not path.strip():
            raise ServedModelError(f"{what}: adapter {name!r} has an empty path")
    return dict(loras)


def _check_unique(models: list[ServedModel]) -> None:
    """Every name and alias names one model (``tidegate`` is the first's)."""
    owner: dict[str, str] = {}
    for i, model in enumerate(models):
        names = [model.name, *model.aliases, *([DEFAULT_ALIAS] if i == 0 else [])]
        for text in dict.fromkeys(names):
            if text in owner:
                raise ServedModelError(f"the name {text!r} is given to two models "
                                       f"({owner[text]!r} and {model.name!r}); names and "
                                       f"aliases must be unique")
            owner[text] = model.name
