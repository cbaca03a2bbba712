"""Tasks in the middle of Redis commands end when cancelled: the probe of issue 14, item 5
(one ``cancel()`` was lost now and then on Python 3.11 inside redis-py's ``wait_for``;
``tidegate.redis_cancellation`` raises it again), and ``cancel_and_wait``."""

from __future__ import annotations

import asyncio
import random

import pytest

from tidegate.cancelling import cancel_and_wait
from tidegate.redis_conn import connect

pytestmark = pytest.mark.timeout(60)


async def test_tasks_busy_with_redis_commands_end_every_time(redis_url: str) -> None:
    redis = connect(redis_url)  # a socket timeout: each command's send goes through wait_for
    await redis.set("k", "v")
    commands = 0

    async def busy() -> None:
        nonlocal commands
        while True:
            await redis.get("k")
            commands += 1

    try:
        for _ in range(40):
            tasks = [asyncio.create_task(busy()) for _ in range(10)]
            before = commands
            while commands < before + 10:  # the tasks are in their loops
                await asyncio.sleep(0)
            await asyncio.sleep(random.uniform(0, 0.003))  # each is inside a command now
            async with asyncio.timeout(5):  # a task that swallowed its cancel would run on
                await cancel_and_wait(*tasks)
            assert all(task.cancelled() for task in tasks)
    finally:
        await redis.aclose()


async def test_one_cancel_ends_every_task_busy_with_redis_commands(redis_url: str) -> None:
    """What arq does on SIGTERM, and what any caller of ``task.cancel()`` expects: the task
    ends at the command it is in. On Python 3.11 without the fix, about a third of these tasks
    ran on; and the connection a cancelled command used answers the next command its own."""
    redis = connect(redis_url)
    await redis.set("k", "v")
    commands = 0

    async def busy(i: int) -> None:
        nonlocal commands
        while True:
            await redis.hset("h", str(i), commands)
            commands += 1

    try:
        for _ in range(40):
            tasks = [asyncio.create_task(busy(i)) for i in range(10)]
            before = commands
            while commands < before + 10:  # the tasks are in their loops
                await asyncio.sleep(0)
            await asyncio.sleep(random.uniform(0, 0.003))  # each is inside a command now
            for task in tasks:
                task.cancel()
            done, running = await asyncio.wait(tasks, timeout=5)
            assert not running and all(task.cancelled() for task in done)
            assert await redis.get("k") == "v"
    finally:
        await redis.aclose()


async def test_results_and_finished_tasks_are_left_alone() -> None:
    async def answer() -> int:
        return 42

    done = asyncio.create_task(answer())
    await asyncio.sleep(0)
    sleeper = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait(done, sleeper)
    assert done.result() == 42 and sleeper.cancelled()
