"""Following one job as a real client does (WebSocket or SSE), checking every event on the way.

A ``Trace`` records what the client saw of a job: arrival time and token count of each token
event, the concatenated text, and every breach of the protocol's promises (event ids 1, 2, 3...
with no gap and no duplicate, one final event and nothing after it, token ``index`` equal to
the tokens before it). A token event may carry several tokens (``token_ids`` is a list), so
tokens are counted as ``len(token_ids)``, never as events. A dropped connection is resumed
with ``last_event_id`` like the Python client does; the resume must not break the sequence.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlencode

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tidegate.benchmarks.harness.load.http import HttpError, sse_events

FINAL_TYPES = frozenset({"done", "error", "rejected"})
# Close codes after which a client resumes (docs/guides/clients/streaming.md: 1001/1012 restart,
# 1013 lagging or Redis).
RESUMABLE_CLOSES = frozenset({1001, 1006, 1011, 1012, 1013})
MAX_RESUMES = 5
MAX_PROBLEMS = 4


@dataclass(slots=True)
class Trace:
    """What one client received for one job."""

    last_id: int = 0
    events: int = 0
    first_event_at: float | None = None  # the replayed ``queued``: the follower is attached
    finals: int = 0
    final: dict | None = None  # the final event
    tokens: int = 0  # sum of len(token_ids) over token events
    text_parts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival of each token event
    token_counts: list[int] = field(default_factory=list)  # tokens in each token event
    started_prompt_tokens: int | None = None
    resumes: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, what: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(what)

    def on_event(self, raw: str | bytes, now: float) -> None:
        try:
            self._on_event(json.loads(raw), raw, now)
        except (ValueError, KeyError, TypeError) as exc:
            self.problem(f"malformed event ({exc!r}): {str(raw)[:120]}")

    def _on_event(self, event: dict, raw: str | bytes, now: float) -> None:
        self.events += 1
        if self.first_event_at is None:
            self.first_event_at = now
        kind, event_id = event.get("type"), event.get("id")
        if event_id is None:  # a protocol frame (an error before a 44xx close), not an event
            self.problem(f"frame without an id: {str(raw)[:120]}")
            return
        if self.finals:
            self.problem(f"event {event_id} ({kind}) after the final event")
        if event_id != self.last_id + 1:
            self.problem(f"event id {event_id} after {self.last_id}")
        self.last_id = max(self.last_id, event_id)
        if kind == "token":
            self._token(event, now)
        elif kind == "started":
            self.started_prompt_tokens = event.get("prompt_tokens")
        elif kind == "restarted":
            self.problem(f"restarted (attempt {event.get('attempt')})")
        elif kind in FINAL_TYPES:
            self.finals += 1
            self.final = event

    def _token(self, event: dict, now: float) -> None:
        n = len(event["token_ids"])
        if event["index"] != self.tokens:
            self.problem(f"token index {event['index']} after {self.tokens} tokens")
        self.tokens += n
        self.text_parts.append(event["text"])
        self.token_times.append(now)
        self.token_counts.append(n)

    @property
    def done(self) -> bool:
        return self.finals > 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _query(token: str | None, after_id: int) -> str:
    params = {k: v for k, v in (("token", token), ("last_event_id", after_id or None)) if v}
    return f"?{urlencode(params)}" if params else ""


async def follow_ws(stream_url: str, token: str | None, trace: Trace, *,
                    headers: dict[str, str] | None = None) -> float | None:
    """Follow over ``WS stream_url?token=``; returns when the final event arrived."""
    final_at = None
    while not trace.done:
        url = stream_url + _query(token, trace.last_id)
        try:
            async with connect(url, compression=None, max_size=None, ping_interval=None,
                               open_timeout=120, close_timeout=5,
                               additional_headers=headers) as ws:
                async for raw in ws:
                    now = time.monotonic()
                    trace.on_event(raw, now)
                    if trace.done and final_at is None:
                        final_at = now
        except InvalidStatus as exc:
            trace.problem(f"WebSocket refused: HTTP {exc.response.status_code}")
            return final_at
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else 1006
            if code not in RESUMABLE_CLOSES and not trace.done:
                trace.problem(f"closed with {code} {exc.rcvd.reason if exc.rcvd else ''}")
                return final_at
        except OSError as exc:
            trace.problem(f"WebSocket connection failed: {exc}")
        if not trace.done and not _may_resume(trace):
            return final_at
    return final_at


async def follow_sse(host: str, port: int, job_id: str, token: str | None, trace: Trace, *,
                     headers: dict[str, str] | None = None) -> float | None:
    """Follow over ``GET /v1/jobs/{id}/events``; returns when the final event arrived."""
    final_at = None
    while not trace.done:
        path = f"/v1/jobs/{job_id}/events" + _query(token, trace.last_id)
        try:
            async for data in sse_events(host, port, path, headers):
                now = time.monotonic()
                trace.on_event(data, now)
                if trace.done and final_at is None:
                    final_at = now
        except HttpError as exc:
            trace.problem(str(exc))
            return final_at
        except (OSError, asyncio.IncompleteReadError) as exc:
            trace.problem(f"SSE connection failed: {exc!r}")
        if not trace.done and not _may_resume(trace):
            return final_at
    return final_at


def _may_resume(trace: Trace) -> bool:
    trace.resumes += 1
    if trace.resumes > MAX_RESUMES:
        trace.problem(f"no final event after {MAX_RESUMES} resumes")
        return False
    return True
