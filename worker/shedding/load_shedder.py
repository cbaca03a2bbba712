"""Load shedding: admit a job only if this worker can still finish it by its deadline.

The worker times every engine step and feeds the shedder (prompt tokens computed, decodes run,
seconds taken). From those it keeps two rates: the step time as a function of the decode batch
size (a line through recent decode steps, since on every device a step costs a fixed part plus a
part per sequence) and prompt tokens per second. A new job's finish time is estimated as
now + (prompt tokens queued ahead + its own) / prefill rate + max_tokens x step time at the batch
size it would join; beyond its deadline (with a safety margin) it is rejected at once, so under
overload the admitted jobs keep their deadlines instead of every job being late. ``max_tokens``
is an upper bound, so the estimate errs towards refusing. Plain Python: no torch.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShedderConfig:
    enabled: bool = True
    safety: float = 1.25  # estimates are multiplied by this before comparing with the deadline
    window: int = 64  # recent steps kept for each rate
    # Until measured: rates assumed optimistic enough to admit, pessimistic enough to learn fast.
    initial_prefill_tok_s: float = 2000.0
    initial_step_s: float = 0.02
    # A step this many times slower than predicted is a stall (the process was paused: SIGSTOP,
    # a long GC or swap), not what steps cost, and is left out, unless ``stalls_to_believe``
    # come in a row: then the machine really got slower and the rates follow it.
    stall_factor: float = 8.0
    stalls_to_believe: int = 3
    min_steps_to_judge: int = 8


@dataclass(frozen=True, slots=True)
class Load:
    """What the engine holds when a job arrives."""

    batch_size: int  # requests running or waiting (each decodes in every step)
    prefill_tokens_ahead: int  # prompt tokens admitted but not yet computed
    max_num_seqs: int
    seat_wait_s: float = 0.0  # when every seat is taken: until the first running job ends


@dataclass(frozen=True, slots=True)
class Estimate:
    finish_s: float  # seconds from now until the job would finish
    admit: bool


class Commitments:
    """(tokens still to generate, seconds left) of every admitted job, and a bound on them all
    that answers most checks at once: a burst of N admissions costs O(N), not O(N^2).

    The caller may give the bound itself (an upper bound on the tokens left, a lower bound on
    the seconds left) and the items as a function, called only when the bound cannot decide:
    an admission into a large batch then costs O(1), not a pass over the batch.
    """

    def __init__(self, items: Iterable[tuple[int, float]] = (), *,
                 bound: tuple[int, float] | None = None,
                 exact: Callable[[], Iterable[tuple[int, float]]] | None = None) -> None:
        self.max_left, self.min_time_s = bound if bound is not None else (0, math.inf)
        self._exact = exact
        self._items: list[tuple[int, float]] | None = None if exact is not None else []
        self._added: list[tuple[int, float]] = []
        for left, time_s in items:
            self.add(left, time_s)

    def add(self, left: int, time_s: float) -> None:
        self._added.append((left, time_s))
        if self._items is not None:
            self._items.append((left, time_s))
        self.max_left = max(self.max_left, left)
        self.min_time_s = min(self.min_time_s, time_s)

    @property
    def items(self) -> list[tuple[int, float]]:
        if self._items is None:
            assert self._exact is not None
            self._items = [*self._exact(), *self._added]
        return self._items

    def hold(self, prefill_s: float, step_s: float, safety: float) -> bool:
        """Whether every job still finishes in time after ``prefill_s`` more prompt work and
        with decode steps of ``step_s``."""
        if (prefill_s + self.max_left * step_s) * safety <= self.min_time_s:
            return True  # even the longest job within the shortest deadline: all hold
        return all((prefill_s + left * step_s) * safety <= time_s
                   for left, time_s in self.items)


class LoadShedder:
    def __init__(self, config: ShedderConfig | None = None) -> None:
        self.config = config or ShedderConfig()
        self._decode: deque[tuple[int, float]] = deque(maxlen=self.config.window)
        self._prefill: deque[tuple[int, float]] = deque(maxlen=self.config.window)
        # The engine thread appends to the windows while the intake estimates on the event
        # loop. tuple(deque) is not atomic: an allocation inside it may run the collector and
        # a finalizer hands the GIL over mid-copy ("deque mutated during iteration", seen once
        # under CI load, killing the worker's intake). Appends and copies hold this lock.
        self._windows = threading.Lock()
        # The step-time line through ``_decode`` (mean batch, mean time, slope, spread), kept
        # until the next decode step: a burst's admissions ask for it once per job.
        self._line: tuple[float, float, float, float] | None = None
        self._stalls = 0  # stalls in a row, left out so far
        self.stalls_ignored = 0

    # ------------------------------------------------------------------ measurements

    def observe_step(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        """Record one engine step. Pure decode steps fit the step-time line; steps with prompt
        tokens give the prefill rate after the decode share of the step is taken out."""
        if seconds <= 0:
            return
        if self._stalled(prompt_tokens, decodes, seconds):
            return
        if prompt_tokens == 0:
            if decodes > 0:
                with self._windows:
                    self._decode.append((decodes, seconds))
                self._line = None
            return
        decode_share = self.step_s(decodes) if decodes else 0.0
        with self._windows:
            self._prefill.append((prompt_tokens, max(seconds - decode_share, seconds * 0.1)))

    def _stalled(self, prompt_tokens: int, decodes: int, seconds: float) -> bool:
        """Whether to leave this step out as a stall: far slower than the rates predict,
        while the rates rest on enough steps, and not yet ``stalls_to_believe`` in a row.
        Without this, one paused step (a worker frozen past its visibility timeout) would
        stay in the window and make the worker refuse every job it could finish."""
        cfg = self.config
        if len(self._decode) + len(self._prefill) < cfg.min_steps_to_judge:
            return False
        predicted = (self.step_s(decodes) if decodes else 0.0) + (
            prompt_tokens / self.prefill_tok_s())
        if seconds <= cfg.stall_factor * predicted:
            self._stalls = 0
            return False
        self._stalls += 1
        if self._stalls >= cfg.stalls_to_believe:
            self._stalls = 0
            return False
        self.stalls_ignored += 1
        return True

    def prefill_tok_s(self) -> float:
        with self._windows:  # a copy, never iterated while the engine thread appends
            pts = tuple(self._prefill)
        if not pts:
            return self.config.initial_prefill_tok_s
        return sum(n for n, _ in pts) / sum(s for _, s in pts)

    def step_s(self, batch_size: int) -> float:
        """Decode step time at ``batch_size``: least squares over recent decode steps."""
        with self._windows:  # a copy: see prefill_tok_s
            pts = tuple(self._decode)
        if not pts:
            return self.config.initial_step_s
        if self._line is None:
            n = len(pts)
            mean_b = sum(b for b, _ in pts) / n
            mean_t = sum(t for _, t in pts) / n
            var = sum((b - mean_b) ** 2 for b, _ in pts)
            slope = (max(0.0, sum((b - mean_b) * (t - mean_t) for b, t in pts) / var)
                     if var else 0.0)
            self._line = (mean_b, mean_t, slope, var)
        mean_b, mean_t, slope, var = self._line
        if var == 0:  # one batch size seen so far: scale the time in proportion, at worst
            return mean_t * max(1.0, batch_size / mean_b)
        return max(mean_t + slope * (batch_size - mean_b), 1e-4)

    # ------------------------------------------------------------------ decision

    def estimate(
        self, prompt_tokens: int, max_tokens: int, load: Load, time_left_s: float,
        running: Commitments | Iterable[tuple[int, float]] = (),
    ) -> Estimate:
        """Finish time of a new job, and whether to admit it.

        ``running``: (tokens still to generate, seconds left) of each admitted job; a new job is
        refused too if the larger batch it makes would push one of them past its deadline.
        """
        if not isinstance(running, Commitments):
            running = Commitments(running)
        batch = min(load.batch_size + 1, load.max_num_seqs)
        prefill_s = (load.prefill_tokens_ahead + prompt_tokens) / self.prefill_tok_s()
        # A job beyond the sequence cap first waits for a seat.
        queue_s = load.seat_wait_s if load.batch_size >= load.max_num_seqs else 0.0
        step = self.step_s(batch)
        finish = (prefill_s + queue_s + max_tokens * step) * self.config.safety
        admit = finish <= time_left_s and running.hold(prefill_s, step, self.config.safety)
        return Estimate(finish, admit=not self.config.enabled or admit)
