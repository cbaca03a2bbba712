"""The one thread that computes with a worker's model: its load, its calibration, every step.

OpenMP (torch's CPU operators and the native kernels share one libgomp) gives each thread that
opens a parallel region a team of its own, kept for that thread's life, and libgomp counts the
threads of every team: once a process holds more than it has cores, its team threads stop
spinning between regions and sleep on a futex after each one. A CPU decode step opens a few
hundred regions, so each step then pays a few hundred wake-ups. A worker that loaded its model
on the event loop's thread and stepped on an executor's held two teams, which on 2 cores is
already too many. So the load, the calibration and the steps all run here, on one thread, and
work that must not wait behind a step (an adapter's load) runs on a thread that ends with the
call, taking its team along.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class EngineThread:
    """A single thread, kept, for the calls that compute with one engine."""

    def __init__(self, name: str = "engine") -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the engine's thread."""
        return await _submit(self._pool, fn, *args, **kwargs)

    def close(self) -> None:
        """End the thread once the call it runs (if any) returns."""
        self._pool.shutdown(wait=False)


async def on_passing_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread that ends when it returns: no OpenMP team
    outlives the call."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="passing")
    try:
        return await _submit(pool, fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)


async def _submit(pool: ThreadPoolExecutor, fn: Callable[P, T], *args: P.args,
                  **kwargs: P.kwargs) -> T:
    """``fn`` on ``pool`` in a copy of the caller's context, as ``asyncio.to_thread`` runs it."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, call)
