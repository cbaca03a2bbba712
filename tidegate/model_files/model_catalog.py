"""Which served model (and adapter) a request's ``model`` and ``lora`` fields name.

A name is a served model's name, one of its aliases, its spec, or ``tidegate`` (the default
model). ``base:NAME`` names adapter NAME of model ``base``: the string is split on its last
':' only when the part before it names a model (``random:tiny`` is a spec, not an adapter).
Whether the adapter exists is the registry's question (``tidegate.adapter_registry``), asked
after this. Plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidegate.model_files.served_model import DEFAULT_ALIAS, NAME_RE, ServedModel


class ModelNotFound(LookupError):
    """No served model (or adapter name) by that name; ``field`` is the request field."""

    def __init__(self, field: str, name: str, message: str):
        super().__init__(message)
        self.field, self.name = field, name


class LoraMismatch(ValueError):
    """``model: base:A`` with ``lora: B``: the two fields name different adapters."""

    def __init__(self, suffix: str, lora: str):
        super().__init__(f"the model names adapter {suffix!r} and lora names {lora!r}; give "
                         f"one, or the same in both")


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What a request runs on: the served model and, optionally, one of its adapters."""

    model: ServedModel
    adapter: str | None = None
    adapter_field: str = "lora"  # the request field that named the adapter (errors name it)


class ModelCatalog:
    """The served models by every name a request may give them; the first is the default."""

    def __init__(self, models: Sequence[ServedModel]):
        if not models:
            raise ValueError("a catalog needs at least one model")
        self.models = list(models)
        self._by_name: dict[str, ServedModel] = {}
        for i, model in enumerate(self.models):
            for text in (model.name, *model.aliases, *([DEFAULT_ALIAS] if i == 0 else [])):
                self._by_name.setdefault(text, model)
        for model in self.models:  # specs last: a spec never shadows a name or an alias
            self._by_name.setdefault(model.spec, model)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        """The served names, the default first."""
        return [m.name for m in self.models]

    def get(self, name: str) -> ServedModel | None:
        """The model a served name, alias or spec names (no adapter suffix)."""
        return self._by_name.get(name)

    def choose(self, model: str | None, lora: str | None = None) -> ModelChoice:
        """The model and adapter of a request. ``ModelNotFound`` (field ``model``) for a name
        nothing answers to; ``LoraMismatch`` when ``model``'s adapter suffix and ``lora``
        disagree."""
        if model is None:
            return ModelChoice(self.default, lora)
        found = self._by_name.get(model)
        if found is not None:
            return ModelChoice(found, lora)
        head, sep, suffix = model.rpartition(":")
        base = self._by_name.get(head) if sep else None
        if base is None or not NAME_RE.match(suffix):
            raise ModelNotFound("model", model, f"the model {model!r} does not exist; served: "
                                f"{', '.join(self.names)}")
        if lora is not None and lora != suffix:
            raise LoraMismatch(suffix, lora)
        return ModelChoice(base, suffix, "model")
