"""The chaos benchmark's plan: every action asked for, spread over the run, in time order."""

from __future__ import annotations

from collections import Counter

from tidegate.benchmarks.harness.run.chaos_monkey import ChaosPlan


def test_schedule_spreads_every_action_over_the_duration() -> None:
    plan = ChaosPlan(duration_s=100, worker_kills=4, redis_restarts=2, gateway_restarts=1)
    schedule = plan.schedule()
    assert Counter(kind for _, kind in schedule) == {"worker": 4, "redis": 2, "gateway": 1}
    times = [at for at, _ in schedule]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100
    assert [at for at, kind in schedule if kind == "worker"] == [12.5, 37.5, 62.5, 87.5]
    # Interleaved: the Redis restarts fall between worker kills, not all at one end.
    assert [kind for _, kind in schedule] == ["worker", "redis", "worker", "gateway", "worker",
                                              "redis", "worker"]


def test_an_empty_plan_does_nothing() -> None:
    assert ChaosPlan(duration_s=10, worker_kills=0, redis_restarts=0,
                     gateway_restarts=0).schedule() == []
