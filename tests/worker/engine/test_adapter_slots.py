"""Adapter slots: resident adapters, least recently used evicted, never one a step needs."""

from __future__ import annotations

import pytest

from tidegate.worker.engine.adapter_slots import AdapterSlots


def test_adapters_fill_free_slots_then_evict_the_least_recently_used() -> None:
    slots = AdapterSlots(2)
    assert slots.place(["a"]) == [(0, "a")]
    assert slots.place(["b", "a"]) == [(1, "b")]
    assert slots.place(["a"]) == []  # resident: nothing to copy
    assert slots.resident == ["b", "a"]
    assert slots.place(["c"]) == [(1, "c")]  # b was used least recently
    assert slots.slot_of("b") is None and slots.slot_of("a") == 0
    assert slots.loads == 3


def test_a_step_never_evicts_its_own_adapters() -> None:
    slots = AdapterSlots(2)
    slots.place(["a", "b"])
    slots.place(["a"])
    assert slots.place(["b", "c"]) == [(0, "c")]  # a goes, though b is older in the step
    with pytest.raises(ValueError, match="a step uses 3 adapters; there are 2 slots"):
        slots.place(["a", "b", "c"])


def test_forget_frees_the_slot() -> None:
    slots = AdapterSlots(1)
    slots.place(["a"])
    slots.forget("a")
    assert slots.place(["b"]) == [(0, "b")]
    with pytest.raises(ValueError, match="num_slots"):
        AdapterSlots(0)
