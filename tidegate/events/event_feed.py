"""One job's stored events, as readers see them (``FeedEvent``, ``stored_events``).

Workers store every event in the job's event stream before they publish it
(``tidegate.events.event_log``), so the stream is always a superset of what was published. A
follower subscribes first, replays the stream, then takes live events, dropping ids it has
already sent and refilling from the stream when a live id skips ahead
(``tidegate.events.event_hub``; ``tidegate.events.follow`` for one follower alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.events.event_log import EVENT_FIELD, entry_id
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
    """The job's stored events with id > ``after_id``, in order (one range read)."""
    entries = await redis.xrange(keys.job_events(job_id), min=entry_id(after_id + 1))
    return [parse_event(fields[EVENT_FIELD]) for _, fields in entries]
