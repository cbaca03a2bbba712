"""The speculation governor: speculates where it measured faster, per class of batch size,
keeps checking the other way, and follows a fixed max batch when given one."""

from __future__ import annotations

import pytest

from tidegate.worker.speculative.speculation_governor import SpeculationGovernor


def drive(governor: SpeculationGovernor, batch: int, steps: int,
          spec_speed: float, plain_speed: float) -> list[bool]:
    """``steps`` decisions at ``batch``, each reported at the given tokens per second."""
    chosen = []
    for _ in range(steps):
        speculate = governor.speculate(batch)
        chosen.append(speculate)
        governor.record(batch, speculate, 100, 100 / (spec_speed if speculate else plain_speed))
    return chosen


def test_measures_both_ways_then_takes_the_faster_and_keeps_checking() -> None:
    g = SpeculationGovernor(warmup=2, explore_every=4)
    chosen = drive(g, 1, 4 + 40, spec_speed=300, plain_speed=100)
    assert chosen[:4] == [True, True, False, False]  # warm-up: each way measured
    rest = chosen[4:]
    # Plain measured 3x slower: checked one step in 4 x 3.
    assert rest.count(False) == 3 and rest.count(True) == 37
    assert g.switched_off() == []
    # At batch 32 plain is faster: speculation switches off there, and stays on at 1.
    chosen = drive(g, 32, 4 + 40, spec_speed=900, plain_speed=1000)
    assert chosen[4:].count(True) == 10  # close behind: checked one step in 4
    assert g.switched_off() == [32]
    assert g.speculate(1)


def test_batch_classes_are_powers_of_two() -> None:
    assert [SpeculationGovernor.batch_class(b) for b in (1, 2, 3, 4, 7, 8, 33)] == [
        1, 2, 2, 4, 4, 8, 32]
    g = SpeculationGovernor(warmup=1, explore_every=1000)
    drive(g, 5, 2, spec_speed=10, plain_speed=20)
    assert not g.speculate(6)  # the same class as 5
    assert g.speculate(8)  # a class not measured yet: measured first


def test_a_workload_change_is_noticed() -> None:
    """Plain wins while drafts are rejected; once they are kept, the checks find it."""
    g = SpeculationGovernor(warmup=2, explore_every=4, smoothing=0.5)
    chosen = drive(g, 2, 20, spec_speed=50, plain_speed=100)
    assert chosen[-8:].count(True) == 1  # plain, bar a check (one in 4 x 2)
    assert g.switched_off() == [2]
    chosen = drive(g, 2, 40, spec_speed=400, plain_speed=100)
    assert chosen[-8:].count(True) >= 7  # speculating again, bar a check
    assert g.switched_off() == []


def test_a_fixed_max_batch_replaces_the_measurement() -> None:
    g = SpeculationGovernor(max_batch=4)
    assert [g.speculate(b) for b in (0, 1, 4, 5, 64)] == [False, True, True, False, False]
    g.record(2, True, 10, 1.0)
    assert g.rate(2, True).samples == 0
    with pytest.raises(ValueError):
        SpeculationGovernor(warmup=0)
