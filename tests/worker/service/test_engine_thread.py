"""The engine's thread: every call on one kept thread, in the caller's context; an adapter's
load on a thread that is gone once the load returns (no OpenMP team outlives it)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from tidegate.worker.service.engine_thread import EngineThread, on_passing_thread

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def where(tag: str, *, scale: int = 1) -> tuple[threading.Thread, str, str]:
    return threading.current_thread(), request_id.get(), tag * scale


async def test_every_call_runs_on_the_same_thread_off_the_loop() -> None:
    thread = EngineThread("engine-m")
    try:
        request_id.set("job-7")
        seen = [await thread.run(where, "ab", scale=i) for i in range(1, 4)]
        loaded = await asyncio.gather(*(thread.run(where, str(i)) for i in range(8)))
    finally:
        thread.close()
    threads = {t for t, _, _ in seen + loaded}
    assert len(threads) == 1 and threading.current_thread() not in threads
    (only,) = threads
    assert only.name.startswith("engine-m")
    assert [(ctx, out) for _, ctx, out in seen] == [("job-7", "ab"), ("job-7", "abab"),
                                                    ("job-7", "ababab")]
    assert [out for _, _, out in loaded] == [str(i) for i in range(8)]  # submitted order
    only.join(timeout=10)  # close() ends it once idle
    assert not only.is_alive()


async def test_an_error_reaches_the_caller_and_the_thread_goes_on() -> None:
    thread = EngineThread()
    try:
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 // 0)
        assert await thread.run(lambda: 6 * 7) == 42
    finally:
        thread.close()


async def test_a_passing_thread_ends_with_its_call() -> None:
    request_id.set("adapter-load")
    first, ctx, out = await on_passing_thread(where, "x", scale=2)
    second, _, _ = await on_passing_thread(where, "y")
    assert (ctx, out) == ("adapter-load", "xx")
    assert first is not second and threading.current_thread() not in (first, second)
    for t in (first, second):
        t.join(timeout=10)
        assert not t.is_alive()
    with pytest.raises(KeyError):
        await on_passing_thread({}.__getitem__, "missing")
