"""Triton's JIT compiles in this process, counted and timed: ``KernelCompiles``.

A Triton kernel compiles on its first launch with each new set of constants and argument
specializations (an integer argument's value 1, a multiple of 16, anything else). Mid-run that
stalls the step it happens in, by up to a second or more for the attention kernels, and every
job waiting behind the step waits as long: a cold wave. After a worker's warm-up each compile
is a shape the warm-up did not cover, or an argument that should not be a compile key
(``do_not_specialize``). ``kernel_compiles()`` installs the one watcher of the process over
Triton's runtime hooks, chaining any hook already there; without Triton, or in its
interpreter (which compiles nothing), it counts nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KEPT = 64  # the latest compiles kept for a report


@dataclass(frozen=True, slots=True)
class Compile:
    kernel: str
    seconds: float
    after_warmup: bool


class KernelCompiles:
    """Counts the compiles Triton's hooks report; ``warmed_up()`` marks where a process's
    warm-up ends, and each later compile goes to ``on_late`` (a worker logs it)."""

    def __init__(self) -> None:
        self.count = 0
        self.late = 0  # after warmed_up()
        self.recent: deque[Compile] = deque(maxlen=KEPT)
        self.on_late: Callable[[Compile], None] | None = None
        self._warm = False
        self._started: dict[Any, float] = {}
        self._lock = threading.Lock()

    def warmed_up(self) -> None:
        self._warm = True

    def before(self, key: Any) -> None:
        with self._lock:
            self._started[key] = time.perf_counter()

    def after(self, key: Any, kernel: str) -> None:
        with self._lock:
            started = self._started.pop(key, None)
            seconds = time.perf_counter() - started if started is not None else 0.0
            done = Compile(kernel, seconds, self._warm)
            self.count += 1
            self.late += self._warm
            self.recent.append(done)
        if done.after_warmup and self.on_late is not None:
            self.on_late(done)

    def install(self) -> bool:
        """Chain into Triton's compile hooks; False where there is no Triton to watch."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        earlier_pre, earlier_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def pre(*, key: Any, **kwargs: Any) -> bool:
            # A true answer would skip the compile: only an earlier hook may give one.
            if earlier_pre is not None and earlier_pre(key=key, **kwargs):
                return True
            self.before(key)
            return False

        def post(*, key: Any, fn: Any, **kwargs: Any) -> None:
            self.after(key, getattr(fn, "name", str(fn)))
            if earlier_post is not None:
                earlier_post(key=key, fn=fn, **kwargs)

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = pre, post
        return True


_WATCH: KernelCompiles | None = None
_WATCH_LOCK = threading.Lock()


def kernel_compiles() -> KernelCompiles:
    """This process's watcher, installed on first use."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = KernelCompiles()
            _WATCH.install()
        return _WATCH
