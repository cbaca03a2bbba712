"""Follow one job's events: replay what is stored, then live pub/sub, no gap, no duplicate.

Workers XADD every event to the job's event stream before they PUBLISH it, so the stream is
always a superset of what was published. A follower subscribes first, replays the stream, then
takes live messages, dropping ids it has already sent and refilling from the stream when a
live id skips ahead (a publish lost to a reconnect or a client-buffer limit).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.jobstore import EVENT_FIELD
from tidegate.protocol import FINAL_EVENT_TYPES


@dataclass(frozen=True, slots=True)
class FeedEvent:
    id: int
    type: str
    raw: str  # the event's JSON exactly as the worker wrote it

    @property
    def final(self) -> bool:
        return self.type in FINAL_EVENT_TYPES

    def data(self) -> dict:
        return json.loads(self.raw)


def parse_event(raw: str) -> FeedEvent:
    obj = json.loads(raw)
    return FeedEvent(id=int(obj["id"]), type=str(obj["type"]), raw=raw)


async def stored_events(redis: aioredis.Redis, job_id: str, after_id: int = 0) -> list[FeedEvent]:
    entries = await redis.xrange(keys.job_events(job_id))
    events = [parse_event(fields[EVENT_FIELD]) for _, fields in entries]
    return [e for e in events if e.id > after_id]


async def follow(
    redis: aioredis.Redis, job_id: str, *, after_id: int = 0, poll_s: float = 1.0
) -> AsyncIterator[FeedEvent]:
    """Yield the job's events with id > ``after_id`` in order, ending after the final one."""
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.job_channel(job_id))
    try:
        # SUBSCRIBE is sent but not confirmed; an event published before Redis applies it
        # and after the replay below would wait for the next quiet poll. The confirmation is
        # the first message on a fresh subscription, so wait for it.
        await pubsub.get_message(timeout=poll_s)
        last = after_id
        for event in await stored_events(redis, job_id, last):
            if event.id <= last:
                continue  # a batch a worker re-sent after a Redis outage
            yield event
            last = event.id
            if event.final:
                return
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)
            if msg is None:
                # Quiet channel: the stream is the truth, so look there for anything missed.
                pending = await stored_events(redis, job_id, last)
            else:
                event = parse_event(msg["data"])
                if event.id <= last:
                    continue
                pending = [event] if event.id == last + 1 else await stored_events(redis, job_id, last)
            for event in pending:
                if event.id <= last:
                    continue
                yield event
                last = event.id
                if event.final:
                    return
    finally:
        await pubsub.aclose()
