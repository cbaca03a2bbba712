"""The WebSocket side of watching a job: relay a hub watch to one client, and the protocol.

Both socket routes speak it once they know which job to follow: the gateway's
``WS /v1/jobs/{id}/stream`` and the API's submit-over-socket ``WS /v1/stream``.

Server -> client text frames (JSON objects):
* job events, exactly as the worker wrote them: ``{"id": N, "type": "queued" | "started" |
  "token" | "done" | "error" | "rejected" | "restarted", ...}``;
* ``{"type": "pong", "data": ...}``, the answer to a client's ping;
* ``{"type": "error", "code": ..., "message": ..., "field"?: ...}`` just before a 44xx close
  (``field``: where in the client's frame the fault lies, for a ``bad_frame``).

Client -> server: ``{"type": "ping", "data": <anything>}`` (application keepalive; the server
also sends protocol-level pings). Any other frame is refused with 4400 (on ``/v1/stream`` the
first frame is the request, see ``tidegate.producer.socket_submit``).

Close codes: 1000 the final event was sent; 1001 the server is going away (resume
elsewhere); 1013 the client fell too far behind (its queue overflowed, or more than the hub's
``backlog_bytes`` waited for it, its connection's unsent bytes included) or the event store is
unavailable (resume with ``last_event_id``, the id of the last event received); 4400 a malformed request or frame;
4401 missing or unknown credentials; 4403 not this caller's job; 4404 unknown job;
4429 the lane's backlog is full (``/v1/stream``; retry later).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from redis.exceptions import RedisError
from starlette.websockets import WebSocket, WebSocketDisconnect

from tidegate import untrusted_json
from tidegate.cancelling import cancel_and_wait
from tidegate.events.event_hub import EventHub, Lagging, Watch
from tidegate.http.ws_protocol import frame_writer, text_frame

CLOSE_DONE = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN = 1013
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_UNKNOWN_JOB = 4404
CLOSE_BACKLOG_FULL = 4429

MAX_FRAME_CHARS = 1 << 20  # a client frame past this is refused unread
MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a control frame's payload is <= 125 bytes, 2 the code
# The largest ``last_event_id`` a client may resume after (18 digits; a job has far fewer
# events, and a stream entry id holds a 64-bit number).
MAX_RESUME_ID = 10**18 - 1
LAGGING_CLOSE_GRACE_S = 30.0


class BadFrame(Exception):
    """A client frame the protocol does not allow; the message says why, ``field`` where in
    the frame (``"frame"``: the frame as a whole)."""

    def __init__(self, reason: str, *, field: str = "frame"):
        super().__init__(reason if field == "frame" else f"{field}: {reason}")
        self.field, self.reason = field, reason


def parse_frame(message: dict[str, Any]) -> dict[str, Any]:
    """A client's ASGI ``websocket.receive`` message as a JSON object, or ``BadFrame``."""
    text = message.get("text")
    if text is None:
        raise BadFrame("frames must be JSON text, not binary")
    if len(text) > MAX_FRAME_CHARS:
        raise BadFrame(f"frame longer than {MAX_FRAME_CHARS} characters")
    try:
        frame = untrusted_json.parse(text, root="frame")
    except untrusted_json.BadJSON as exc:  # not JSON, too deep, a lone surrogate
        reason = f"frame is not valid JSON: {exc.reason}" if exc.field == "frame" else exc.reason
        raise BadFrame(reason, field=exc.field) from None
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        raise BadFrame('frame must be a JSON object with a string "type"')
    return frame


def close_reason(reason: str) -> str:
    """``reason`` cut to at most 123 UTF-8 bytes on a character boundary (a longer one makes
    the close itself fail); lone surrogates, which cannot be encoded, become ``?``."""
    encoded = reason.encode("utf-8", "replace")
    if len(encoded) <= MAX_CLOSE_REASON_BYTES:
        return encoded.decode()
    return encoded[:MAX_CLOSE_REASON_BYTES].decode("utf-8", "ignore")  # drops a cut character


async def close(ws: WebSocket, code: int, reason: str, *, timeout_s: float = 2.0) -> bool:
    """Close unless the client is already gone; bounded, since a stalled peer never acks.
    False if the close could not be sent within ``timeout_s``."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        try:
            async with asyncio.timeout(timeout_s):
                await ws.close(code, close_reason(reason))
        except TimeoutError:
            return False
    return True


async def refuse(ws: WebSocket, code: int, error: str, message: str,
                 **extra: object) -> None:
    """An error frame naming what was wrong, then the close."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await ws.send_text(json.dumps({"type": "error", "code": error, "message": message,
                                       **extra}))
    await close(ws, code, message)


async def relay(ws: WebSocket, hub: EventHub, job_id: str, after_id: int) -> None:
    """Send the job's events after ``after_id``, answer pings, close as the protocol says."""
    send_lock = asyncio.Lock()  # events and pongs share the socket
    async with hub.watch(job_id, after_id) as watch:
        sender = asyncio.create_task(_send_events(ws, watch, send_lock))
        receiver = asyncio.create_task(_answer_frames(ws, send_lock))
        # A stalled client blocks its sender inside send(); the hub's overflow ends it.
        watch.on_lag = sender.cancel
        if (writer := frame_writer(ws.scope)) is not None:
            # Live events while the sender is idle: one shared frame written straight to the
            # transport, no task wake-up (the hot path at thousands of clients). A refusal
            # (write buffer full, closing) sends the event through the sender instead.
            watch.direct = lambda event: writer.write(watch.encoded(event, text_frame))
            # What the connection holds unread counts toward the watcher's backlog limit.
            watch.backlog = writer.backlog_bytes
        try:
            await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.direct = None  # nothing more reaches the client but the close
            # A cancel can be lost in a Redis command (tidegate.cancelling): a sender that ran
            # on would stream the whole job before the refusal of a bad frame went out.
            await cancel_and_wait(sender, receiver)
    if watch.lagging.is_set():
        # The close frame queues behind what the client has not read yet: give a slow client
        # time to get there (the watcher is already gone, so waiting costs almost nothing);
        # a dead one is dropped when the grace runs out (aborted: a plain close would wait
        # for its write buffer to drain, which never happens, and hold the socket forever).
        if not await close(ws, CLOSE_TRY_AGAIN, f"lagging; resume after event {watch.last}",
                           timeout_s=LAGGING_CLOSE_GRACE_S) and writer is not None:
            writer.abort()
        return
    if not receiver.cancelled() and (exc := receiver.exception()) is not None:
        if isinstance(exc, BadFrame):
            return await refuse(ws, CLOSE_BAD_REQUEST, "bad_frame", str(exc), field=exc.field)
        return  # the receive channel broke: the client is gone
    if sender.cancelled():
        return  # the client left
    exc = sender.exception()
    if exc is None and sender.result():
        return await close(ws, CLOSE_DONE, "done")
    if isinstance(exc, RedisError | OSError):
        return await close(ws, CLOSE_TRY_AGAIN, "the event store is unavailable")
    if exc is not None and not isinstance(exc, WebSocketDisconnect | Lagging):
        raise exc


async def _send_events(ws: WebSocket, watch: Watch, lock: asyncio.Lock) -> bool:
    """True once the final event went out; False if the client left."""
    send = ws.send  # the ASGI message directly: this loop is the gateway's hottest path
    try:
        while not watch.finished:
            try:
                event = await watch.next()
            except StopAsyncIteration:
                break
            assert event is not None
            async with lock:
                await send({"type": "websocket.send", "text": event.raw})
                for more in watch.take_ready():  # a backlog goes out without more wake-ups
                    await send({"type": "websocket.send", "text": more.raw})
    except WebSocketDisconnect:
        return False
    return True


async def _answer_frames(ws: WebSocket, lock: asyncio.Lock) -> None:
    """Until the client disconnects: pong its pings, refuse anything else (``BadFrame``)."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        frame = parse_frame(message)
        if frame["type"] != "ping":
            raise BadFrame(f'unexpected frame type {frame["type"]!r}; only "ping" is accepted')
        async with lock:
            await ws.send_text(json.dumps({"type": "pong", "data": frame.get("data")}))
