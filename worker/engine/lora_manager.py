"""The engine's LoRA adapters: those registered (checked and staged on the host) and those
resident in the device's slots.

Registering reads a PEFT directory and checks it against the model once; a step then asks
for its adapters' slots (``slots_for``), which copies in the adapters not resident, evicting
the least recently used ones (``AdapterSlots``). The scheduler keeps the adapters of running
requests within the slot count, so every step's adapters fit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from tidegate.model_files.model_source import ModelLoadError
from tidegate.worker.engine.adapter_slots import AdapterSlots
from tidegate.worker.models.loaders.lora_adapter import load_lora_adapter
from tidegate.worker.models.lora_weights import AdapterMismatch, LoraWeights, StagedAdapter

log = logging.getLogger("tidegate.engine")


class AdapterError(ValueError):
    """An adapter that cannot be registered: unreadable, unsupported, or not this model's."""


class LoraManager:
    """Registered adapters (name -> staged on the host) and the device slots they run from."""

    def __init__(self, weights: LoraWeights) -> None:
        self.weights = weights
        self.slots = AdapterSlots(weights.num_slots)
        self._staged: dict[str, StagedAdapter] = {}
        self._paths: dict[str, str] = {}
        # Registration runs on the service's threads while the engine thread steps.
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return self.weights.num_slots

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._staged)

    def __contains__(self, name: object) -> bool:
        return name in self._staged

    def add(self, name: str, path: str) -> None:
        """Register the adapter in the PEFT directory ``path`` as ``name``: a no-op when it is
        registered from that path already; ``AdapterError`` saying why it cannot be."""
        resolved = str(Path(path).expanduser().resolve())
        with self._lock:
            known = self._paths.get(name)
        if known is not None:
            if known != resolved:
                raise AdapterError(f"adapter {name!r} is already loaded from {known}")
            return
        try:
            staged = self.weights.stage(load_lora_adapter(resolved, name))
        except (ModelLoadError, AdapterMismatch) as exc:
            raise AdapterError(f"adapter {name!r} ({path}): {exc}") from exc
        except OSError as exc:
            raise AdapterError(f"adapter {name!r} ({path}): cannot be read ({exc})") from exc
        with self._lock:
            if self._paths.setdefault(name, resolved) != resolved:
                raise AdapterError(f"adapter {name!r} is already loaded from "
                                   f"{self._paths[name]}")
            self._staged[name] = staged
        log.info("adapter %s: rank %d, %.1f MB, from %s", name, staged.rank,
                 staged.nbytes / 1e6, resolved)

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """Each of a step's adapters' slot, copying in those not resident (engine thread)."""
        wanted = list(dict.fromkeys(names))
        for slot, name in self.slots.place(wanted):
            self.weights.load(slot, self._staged[name])
        return {name: self.slots.slot_of(name) for name in wanted}  # type: ignore[misc]
