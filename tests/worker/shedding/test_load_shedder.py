"""Load shedder: rates learned from steps, finish-time estimates, admit or reject. No torch."""

from __future__ import annotations

import pytest

from tidegate.worker.shedding.load_shedder import Load, LoadShedder, ShedderConfig


def trained() -> LoadShedder:
    s = LoadShedder(ShedderConfig(safety=1.0))
    # Decode steps cost 10 ms + 1 ms per sequence; prefill runs at 1000 tokens/s.
    for b in (1, 4, 8, 16, 8, 4):
        s.observe_step(0, b, 0.010 + 0.001 * b)
    s.observe_step(500, 0, 0.5)
    s.observe_step(200, 4, 0.2 + 0.014)  # mixed step: the decode share is taken out
    return s


def test_step_time_is_a_line_through_decode_steps() -> None:
    s = trained()
    assert s.step_s(1) == pytest.approx(0.011)
    assert s.step_s(32) == pytest.approx(0.042)


def test_prefill_rate_excludes_the_decode_share_of_mixed_steps() -> None:
    assert trained().prefill_tok_s() == pytest.approx(1000.0)


def test_estimate_and_decision() -> None:
    s = trained()
    load = Load(batch_size=3, prefill_tokens_ahead=300, max_num_seqs=32)
    # (300 + 100) / 1000 s of prefill + 50 tokens x step_s(4) = 0.4 + 50 * 0.014 = 1.1 s
    est = s.estimate(100, 50, load, time_left_s=1.2)
    assert est.finish_s == pytest.approx(1.1) and est.admit
    assert not s.estimate(100, 50, load, time_left_s=1.0).admit


def test_a_full_batch_adds_the_wait_for_a_seat() -> None:
    s = trained()
    free = s.estimate(10, 10, Load(31, 0, 32, seat_wait_s=2.0), 100).finish_s
    full = s.estimate(10, 10, Load(32, 0, 32, seat_wait_s=2.0), 100).finish_s
    assert full == pytest.approx(free + 2.0)


def test_safety_margin_and_disabled_shedder() -> None:
    margin = LoadShedder(ShedderConfig(safety=2.0))
    margin.observe_step(0, 1, 0.1)
    assert not margin.estimate(1, 10, Load(0, 0, 8), time_left_s=1.5).admit  # 2 x ~1.0 s
    off = LoadShedder(ShedderConfig(enabled=False))
    off.observe_step(0, 1, 1.0)
    assert off.estimate(1, 1000, Load(0, 0, 8), time_left_s=0.001).admit


def test_one_batch_size_seen_scales_proportionally_upwards_only() -> None:
    s = LoadShedder()
    for _ in range(5):
        s.observe_step(0, 4, 0.04)
    assert s.step_s(8) == pytest.approx(0.08) and s.step_s(2) == pytest.approx(0.04)


def test_untrained_shedder_uses_its_priors() -> None:
    s = LoadShedder(ShedderConfig(initial_prefill_tok_s=100.0, initial_step_s=0.5))
    assert s.prefill_tok_s() == 100.0 and s.step_s(16) == 0.5


def test_a_job_that_would_push_a_running_job_past_its_deadline_is_refused() -> None:
    s = trained()
    load = Load(batch_size=1, prefill_tokens_ahead=0, max_num_seqs=32)
    # Alone the newcomer fits easily, but the running job has 100 tokens left and 1.25 s:
    # at batch 2 (12 ms a step) it needs 0.01 + 1.2 s; at batch 1 it would have needed 1.1 s.
    assert s.estimate(10, 10, load, 10.0, running=[(100, 1.3)]).admit
    assert not s.estimate(10, 10, load, 10.0, running=[(100, 1.2)]).admit


def test_estimates_on_the_event_loop_survive_steps_recorded_by_the_engine_thread() -> None:
    # The intake estimates (event loop) while the engine thread records steps: iterating the
    # step windows while they grew raised "deque mutated during iteration", which killed the
    # intake task and left the worker heartbeating but taking no job.
    import sys
    import threading

    shedder = LoadShedder(ShedderConfig(window=4096))
    for b in range(1, 4000):
        shedder.observe_step(0, b % 7 + 1, 0.001 * (b % 7 + 1))
        shedder.observe_step(64, 1, 0.01)
    stop = threading.Event()

    def engine_steps() -> None:
        b = 0
        while not stop.is_set():
            b += 1
            shedder.observe_step(0, b % 7 + 1, 0.001 * (b % 7 + 1))
            shedder.observe_step(64, b % 3, 0.01)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=engine_steps)
    thread.start()
    try:
        for _ in range(300):
            shedder._line = None  # refit every time, as after each decode step
            shedder.step_s(4)
            shedder.prefill_tok_s()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


def test_one_stalled_step_is_left_out_but_a_lasting_slowdown_is_learned() -> None:
    """A worker paused mid-step (SIGSTOP past its visibility timeout, a long GC) records one
    step of many seconds; kept, it would make the worker refuse every job it could finish
    (and, refusing, it would run no step to wash it out)."""
    s = trained()
    before = s.step_s(1)
    s.observe_step(0, 1, 35.0)
    assert s.step_s(1) == pytest.approx(before) and s.stalls_ignored == 1
    assert s.estimate(20, 800, Load(0, 0, 1), time_left_s=300).admit
    s.observe_step(0, 1, 0.011)  # running normally again: the count of stalls starts over
    for _ in range(3):  # three slow steps in a row: the machine is slower now
        s.observe_step(0, 1, 0.5)
    assert s.stalls_ignored == 3 and s.step_s(1) > 5 * before
