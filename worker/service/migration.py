"""Request migration: where a job taken over from a dead worker continues.

Its clients have seen exactly its stored events, so the tokens those events carry are the
job's generated tokens so far: the new worker runs its prompt plus these tokens as the prefix
and samples on with the same RNG stream (``job_seed``), announcing ``migrated`` instead of
starting over. Continuing is impossible when the stored events no longer hold every token
from the first (the stream was trimmed, or expired), or when they do not add up (indices with a
gap); then the job runs again from the start after a ``restarted`` event. The engine makes the
last check: the tokens must give the text already sent (``tidegate.worker.engine.engine.ResumeError``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tidegate.events.event_feed import FeedEvent
from tidegate.protocol import Job


@dataclass(frozen=True, slots=True)
class Resume:
    """What a migrated job continues from."""

    token_ids: tuple[int, ...]  # every token its clients received, in order
    text: str  # the text those tokens' events carried


def resume_point(events: list[FeedEvent]) -> Resume | None:
    """The tokens a job's stored events hold, or None if they cannot be continued from."""
    if not events or events[0].id != 1:
        return None  # trimmed or expired: the first tokens are gone
    token_ids: list[int] = []
    texts: list[str] = []
    for expected_id, event in enumerate(events, start=1):
        if event.id != expected_id:
            return None
        data = event.data()
        kind = data["type"]
        if kind == "restarted":  # an earlier run was dropped: the tokens count from here
            token_ids, texts = [], []
        elif kind == "token":
            if data["index"] != len(token_ids):
                return None
            token_ids += data["token_ids"]
            texts.append(data["text"])
        elif kind in ("done", "error", "rejected"):
            return None  # it ended: nothing to continue
    return Resume(tuple(token_ids), "".join(texts))


def job_seed(job: Job) -> int:
    """The job's RNG seed: its own, or one drawn from its id, so that any worker running it
    draws the same stream (a migrated job samples on as if never interrupted)."""
    if job.sampling.seed is not None:
        return job.sampling.seed
    digest = hashlib.blake2b(job.id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
