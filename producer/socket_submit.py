"""``WS /v1/stream``: submit a job and watch it on one socket (one round trip for chat UIs).

The client's first frame is one of:
* ``{"type": "generate", "request": {<a POST /v1/jobs body>}, "api_key": "..."}``: validated,
  admitted and enqueued exactly as ``POST /v1/jobs``; the server answers ``{"type": "accepted",
  "id", "status", "stream_token"}`` and then relays the job's events;
* ``{"type": "resume", "job_id": "...", "last_event_id": N, "api_key" | "token": "..."}``:
  the events after N of a job submitted earlier (after a dropped connection).

``api_key`` is for browsers, which cannot set headers on a WebSocket; other clients may send
``Authorization: Bearer <key>`` on the upgrade instead. A refused request gets ``{"type":
"error", "status": <the HTTP API's status>, "error": <its JSON error body>}`` and a close code:
4400 invalid (400/413/422), 4401, 4403, 4404, 4409 (idempotency conflict), 4429 backlog full
or rate limited (``tidegate.producer.submit.rate_limit``),
1013 store unavailable. After the first frame the protocol is ``tidegate.events.ws_relay``'s.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from redis.exceptions import RedisError
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tidegate import keys
from tidegate.events.ws_relay import (
    CLOSE_BAD_REQUEST,
    CLOSE_TRY_AGAIN,
    MAX_RESUME_ID,
    BadFrame,
    close,
    parse_frame,
    relay,
)
from tidegate.http.auth import AuthError, job_access
from tidegate.producer.errors import FieldError
from tidegate.producer.submit.backlog import LaneFull
from tidegate.producer.submit.idempotency import ClaimInProgress
from tidegate.producer.submit.refusal import Refusal, refusal_of
from tidegate.producer.submit.submit_path import SubmitPath

FIRST_FRAME_TIMEOUT_S = 30.0
CLOSE_FOR_STATUS = {400: CLOSE_BAD_REQUEST, 401: 4401, 403: 4403, 404: 4404, 409: 4409,
                    413: CLOSE_BAD_REQUEST, 422: CLOSE_BAD_REQUEST, 429: 4429,
                    503: CLOSE_TRY_AGAIN}


class SocketSubmit:
    """The ``/v1/stream`` route over a ``SubmitPath``."""

    def __init__(self, path: SubmitPath):
        self.path = path
        self.routes = [WebSocketRoute("/v1/stream", self.stream)]

    async def stream(self, ws: WebSocket) -> None:
        await ws.accept()
        try:
            async with asyncio.timeout(FIRST_FRAME_TIMEOUT_S):
                message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            frame = parse_frame(message)
            job_id, after_id = await self._start(ws, frame)
        except TimeoutError:
            return await self._refuse(ws, _invalid("request", "no request frame within "
                                                   f"{FIRST_FRAME_TIMEOUT_S:.0f} s"))
        except BadFrame as exc:
            return await self._refuse(ws, _invalid(exc.field, exc.reason))
        except WebSocketDisconnect:
            return
        except (Refusal, AuthError, LaneFull, ClaimInProgress, RedisError) as exc:
            return await self._refuse(ws, refusal_of(exc))
        try:
            await relay(ws, self.path.hub, job_id, after_id)
        except RedisError:
            await close(ws, CLOSE_TRY_AGAIN, "the event store is unavailable")

    async def _start(self, ws: WebSocket, frame: dict[str, Any]) -> tuple[str, int]:
        """Act on the first frame: (job id, resume point) to relay from."""
        authorization = ws.headers.get("authorization")
        api_key = frame.get("api_key")
        if api_key is not None:
            if not isinstance(api_key, str):
                raise _invalid("api_key", "must be a string")
            authorization = f"Bearer {api_key}"
        if frame["type"] == "generate":
            _only(frame, {"type", "request", "api_key"})
            tenant = self.path.auth.tenant(authorization)
            claim, status, _code = await self.path.accept(tenant, frame.get("request"))
            await ws.send_text(json.dumps({"type": "accepted", "id": claim.job_id,
                                           "status": status,
                                           "stream_token": claim.stream_token}))
            return claim.job_id, 0
        if frame["type"] == "resume":
            _only(frame, {"type", "job_id", "last_event_id", "api_key", "token"})
            job_id, after_id, token = (frame.get("job_id"), frame.get("last_event_id", 0),
                                       frame.get("token"))
            if not isinstance(job_id, str) or not keys.is_valid_job_id(job_id):
                raise _invalid("job_id", "must be a job id string")
            if (not isinstance(after_id, int) or isinstance(after_id, bool)
                    or not 0 <= after_id <= MAX_RESUME_ID):
                raise _invalid("last_event_id", f"must be an integer from 0 to {MAX_RESUME_ID}")
            if token is not None and not isinstance(token, str):
                raise _invalid("token", "must be a string")
            if token is None:
                self.path.auth.tenant(authorization)  # 401 before the job is looked up
            access = await job_access(self.path.redis, job_id)
            if access is None:
                raise Refusal(404, "not_found", f"no job with id {job_id!r}")
            self.path.auth.check_stream(access, authorization=authorization, token=token)
            return job_id, after_id
        raise _invalid("type", f'must be "generate" or "resume", not {frame["type"]!r}')

    async def _refuse(self, ws: WebSocket, refusal: Refusal) -> None:
        body = json.loads(refusal.response().body)
        try:
            await ws.send_text(json.dumps({"type": "error", "status": refusal.status, **body}))
        except (WebSocketDisconnect, RuntimeError, OSError):
            return
        await close(ws, CLOSE_FOR_STATUS.get(refusal.status, CLOSE_BAD_REQUEST),
                    refusal.message)


def _only(frame: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(frame) - allowed)
    if extra:
        raise _invalid(extra[0], f"unknown field in a {frame['type']!r} frame")


def _invalid(field: str, reason: str) -> Refusal:
    return Refusal(400 if field == "frame" else 422, "invalid_request",
                   f"{field}: {reason}", [FieldError(field=field, reason=reason)])
