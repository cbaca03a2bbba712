"""Which LoRA adapters sit in the device's adapter slots: a fixed number of slots, least
recently used evicted.

A step can only run adapters that are resident, and an adapter in use by a running request
must stay resident, so the scheduler never runs more distinct adapters than there are slots
(``Scheduler``'s ``max_adapters``); ``place`` then always finds room. Plain Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class AdapterSlots:
    """Adapter name -> slot, for ``num_slots`` slots; the oldest unused one is reused."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be at least 1")
        self.num_slots = num_slots
        # Resident adapters, least recently used first.
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.loads = 0  # adapters copied in, evictions and first loads alike

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    @property
    def resident(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._slots)

    def place(self, names: Iterable[str]) -> list[tuple[int, str]]:
        """Make every adapter in ``names`` (one step's) resident and most recently used; the
        (slot, name) pairs that must be copied in, in order. Evicts the least recently used
        adapters not in ``names``; ``ValueError`` if ``names`` holds more than the slots."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step uses {len(wanted)} adapters; there are "
                             f"{self.num_slots} slots")
        keep = set(wanted)
        loads: list[tuple[int, str]] = []
        for name in wanted:
            slot = self._slots.get(name)
            if slot is None:
                slot = self._take(keep)
                self._slots[name] = slot
                loads.append((slot, name))
            self._slots.move_to_end(name)
        self.loads += len(loads)
        return loads

    def forget(self, name: str) -> None:
        """Free an adapter's slot (the adapter was removed)."""
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    def _take(self, keep: set[str]) -> int:
        if self._free:
            return self._free.pop()
        victim = next(name for name in self._slots if name not in keep)
        return self._slots.pop(victim)
