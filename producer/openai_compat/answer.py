"""One enqueued job answered in OpenAI's shape: its events followed (through the API process's
``EventHub``, as the gateway's watchers are) until the final one and rendered as one JSON body
or as server-sent events.

The status line waits for the job's first event after ``queued``, so a job a worker rejects at
once gets a real 429/504 instead of an error inside a 200 stream. A client that leaves stops
the follow (and its pub/sub subscription) at once and cancels the job: nobody will read it.

A worker that dies mid-job is replaced and the job restarts (``restarted``). A JSON answer
only uses the final text, so it is unaffected. A stream cannot take back text it has sent:
it goes on as long as the new run repeats the text already sent (greedy or seeded requests
do) and ends with an error chunk once the new run's text departs from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from tidegate.cancelling import cancel_and_wait
from tidegate.events.event_feed import FeedEvent
from tidegate.events.event_hub import EventHub, Lagging
from tidegate.jobstore import request_cancel
from tidegate.producer.openai_compat.errors import OpenAIError, from_error_event, from_rejected
from tidegate.producer.openai_compat.format import (
    FINISH_REASONS,
    ChatShape,
    ChoiceAnswer,
    Shape,
    TokenLogprob,
    TokenSpeller,
)
from tidegate.structured.tool_calls import ToolFormat

log = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class Answer:
    """An ASGI app answering one job; build it after the job was enqueued."""

    def __init__(self, redis: aioredis.Redis, hub: EventHub, job_id: str, shape: Shape,
                 speller: TokenSpeller, *, stream: bool, retry_after_s: int):
        self.redis, self.hub, self.job_id = redis, hub, job_id
        self.shape, self.speller = shape, speller
        self.stream = stream
        self.retry_after_s = retry_after_s  # what a client a worker turned away is told to wait
        self._gone = False  # the client left (found by a failed send)
        self._send: Send | None = None
        self._started = False  # the status line went out
        self._choices = [_ChoiceStream() for _ in range(shape.n)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        answer = asyncio.create_task(self._answer())
        listener = asyncio.create_task(_until_disconnect(receive))
        try:
            await asyncio.wait({answer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A task cancel (not a level-triggered cancel scope) lets the watch's cleanup await
            # the release of its subscription, as the gateway does; repeated while the answer
            # runs on, since a cancel can be lost inside a Redis command (tidegate.cancelling).
            await cancel_and_wait(answer, listener)
        if answer.cancelled() or self._gone:
            await self._cancel_job()
        elif answer.exception() is not None:
            raise answer.exception()  # type: ignore[misc]

    async def _answer(self) -> None:
        try:
            async with self.hub.watch(self.job_id) as watch:
                feed = watch.events()
                await (self._relay(feed) if self.stream else self._collect(feed))
        except OpenAIError as error:
            await self._fail(error)
        except RedisError as exc:
            await self._fail(OpenAIError(503, f"the event store is unavailable "
                                         f"({type(exc).__name__}); retry later",
                                         code="service_unavailable"))
        except Lagging:  # the client reads slower than the job streams
            await self._fail(OpenAIError(503, "the client fell too far behind the stream; retry",
                                         code="service_unavailable"))
        except OSError:  # a send to a client that left (servers of ASGI spec 2.4 raise)
            self._gone = True
        except Exception:
            log.exception("answering job %s failed", self.job_id)
            await self._fail(OpenAIError(500, "internal server error", code="internal_error"))

    # ------------------------------------------------------------------ JSON

    async def _collect(self, feed: AsyncIterator[FeedEvent]) -> None:
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.shape.n)]
        chars = [0] * self.shape.n
        async for event in feed:
            data = event.data()
            if event.type == "token":
                k = data.get("choice") or 0
                if self.shape.logprobs:
                    logprobs[k].append(self.speller.logprob(data, chars[k]))
                chars[k] += len(data["text"])
            elif event.type == "restarted":  # the final text is the new run's
                logprobs, chars = [[] for _ in range(self.shape.n)], [0] * self.shape.n
            elif event.type == "done":
                answers = [ChoiceAnswer(c["index"], c["text"], logprobs[c["index"]],
                                        _finish_reason(c), c.get("tool_calls"))
                           for c in _choices(data)]
                return await self._json(200, self.shape.body(answers, data["usage"]))
            else:
                self._raise_if_failed(event.type, data)

    # ------------------------------------------------------------------ stream

    async def _relay(self, feed: AsyncIterator[FeedEvent]) -> None:
        async for event in feed:
            data = event.data()
            if event.type == "queued":
                continue
            self._raise_if_failed(event.type, data)
            if not self._started:
                await self._start_stream()
            if event.type == "token":
                await self._token(data)
            elif event.type == "restarted":
                self._restart()
            elif event.type == "done":
                return await self._finish(data)

    async def _start_stream(self) -> None:
        await self._start(200, _SSE_HEADERS)
        for k in range(self.shape.n):
            first = self.shape.first_chunk(k)
            if first is not None:
                await self._event(first)

    async def _token(self, data: dict[str, Any]) -> None:
        k = data.get("choice") or 0
        choice = self._choices[k]
        offset = choice.run_chars
        choice.run_chars += len(data["text"])
        replaying = choice.replay is not None
        fresh = choice.fresh(data["text"])
        if fresh is None:
            raise _diverged()
        if replaying and not fresh:
            return  # repeats text already sent, logprobs included
        if self.shape.logprobs:
            choice.pending.append(self.speller.logprob(data, offset))
        if fresh:
            choice.sent += fresh
            text = choice.releasable(self.shape.tool_format)
            if text:
                pending, choice.pending = choice.pending, []
                await self._event(self.shape.text_chunk(text, pending, k))

    def _restart(self) -> None:
        for choice in self._choices:
            choice.restart()

    async def _finish(self, data: dict[str, Any]) -> None:
        if any(choice.replay is not None for choice in self._choices):
            raise _diverged()  # the new run ended short of what was already sent
        for done in _choices(data):
            k, choice = done["index"], self._choices[done["index"]]
            reason = _finish_reason(done)
            calls = done.get("tool_calls")
            if calls and isinstance(self.shape, ChatShape):
                await self._event(self.shape.tool_calls_chunk(calls, choice.pending, k))
                choice.pending, reason = [], "tool_calls"
            elif choice.released < len(choice.sent):  # held text that was no call after all
                held, choice.released = choice.sent[choice.released:], len(choice.sent)
                await self._event(self.shape.text_chunk(held, choice.pending, k))
                choice.pending = []
            await self._event(self.shape.finish_chunk(reason, choice.pending, k))
        if self.shape.include_usage:
            await self._event(self.shape.usage_chunk(data["usage"]))
        await self._done()

    # ------------------------------------------------------------------ sending

    async def _fail(self, error: OpenAIError) -> None:
        if not self._started:
            return await self._json(error.status, error.body(), error.headers)
        await self._event(error.body())
        await self._done()

    async def _json(self, status: int, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> None:
        content = json.dumps(body).encode()
        extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await self._start(status, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(content)).encode()), *extra])
        await self._body(content, more=False)

    async def _event(self, chunk: dict[str, Any]) -> None:
        await self._body(b"data: " + json.dumps(chunk).encode() + b"\n\n", more=True)

    async def _done(self) -> None:
        await self._body(b"data: [DONE]\n\n", more=False)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert self._send is not None
        self._started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, content: bytes, *, more: bool) -> None:
        assert self._send is not None
        await self._send({"type": "http.response.body", "body": content, "more_body": more})

    def _raise_if_failed(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "rejected":
            raise from_rejected(data.get("reason", ""), data.get("message", ""),
                                retry_after_s=self.retry_after_s)
        if kind == "error":
            raise from_error_event(data.get("code", ""), data.get("message", ""))

    async def _cancel_job(self) -> None:
        with contextlib.suppress(RedisError):  # best effort: the job's deadline ends it anyway
            await request_cancel(self.redis, self.job_id)


@dataclass(slots=True)
class _ChoiceStream:
    """What one choice has streamed: its text (sent, and held where a tool call may begin),
    and after a restart the new run's text until it passes what was sent."""

    sent: str = ""  # text received so far, held text included
    released: int = 0  # characters of it sent to the client
    replay: str | None = None
    run_chars: int = 0  # characters of text the current run has produced
    pending: list[TokenLogprob] = field(default_factory=list)  # logprobs not yet in a chunk

    def fresh(self, text: str) -> str | None:
        """The part of a token's text not yet sent; None once a restarted run departs from it."""
        if self.replay is None:
            return text
        replay = self.replay + text
        if not (self.sent.startswith(replay) or replay.startswith(self.sent)):
            return None
        if len(replay) <= len(self.sent):
            self.replay = replay if len(replay) < len(self.sent) else None
            return ""
        self.replay = None
        return replay[len(self.sent):]

    def releasable(self, fmt: ToolFormat | None) -> str:
        """Text received that can go out now: all of it, except, with tools offered, from
        where a call may begin (held until the reply ends and its calls are read)."""
        start = fmt.call_start(self.sent) if fmt is not None else None
        limit = len(self.sent) if start is None else max(start, self.released)
        text = self.sent[self.released:limit]
        self.released = limit
        return text

    def restart(self) -> None:
        self.pending, self.run_chars = [], 0
        self.replay = "" if self.sent else None


def _choices(done: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``done`` event's choices (one, from its own fields, for a job with n = 1)."""
    return done.get("choices") or [{"index": 0, "text": done["text"],
                                    "finish_reason": done["finish_reason"],
                                    "tool_calls": done.get("tool_calls")}]


def _finish_reason(done: dict[str, Any]) -> str:
    reason = FINISH_REASONS.get(done["finish_reason"])
    if reason is None:
        raise OpenAIError(500, "the job ended with an error", code=done["finish_reason"])
    return reason


def _diverged() -> OpenAIError:
    return OpenAIError(500, "the worker serving this request was replaced and the new run's text "
                       "differs from the text already streamed; retry the request",
                       code="restarted")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # a request body was read before the answer began; nothing else means anything
