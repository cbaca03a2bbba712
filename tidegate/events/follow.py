"""Follow one job's events (replay, then live) through a private ``EventHub``: for scripts,
tests and tools. Servers follow through their process's shared hub instead."""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from tidegate.events.event_feed import FeedEvent
from tidegate.events.event_hub import EventHub


async def follow(
    redis: aioredis.Redis, job_id: str, *, after_id: int = 0, poll_s: float = 1.0
) -> AsyncIterator[FeedEvent]:
    """Yield the job's events with id > ``after_id`` in order, ending after the final one.

    A private hub (one pub/sub connection) for one follower: scripts, tests, tools. Servers
    follow through their process's shared ``EventHub`` instead.
    """
    hub = EventHub(redis, poll_s=poll_s)
    await hub.start()
    try:
        async with hub.watch(job_id, after_id) as watch:
            async for event in watch.events():
                yield event
    finally:
        await hub.stop()
