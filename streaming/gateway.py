"""The WebSocket gateway: every event of a job relayed from Redis to each client watching it.

``WS /v1/jobs/{id}/stream`` sends the job's events (those after ``?last_event_id=N``, if given)
as text frames holding the exact JSON the worker wrote: first the stored ones, then live ones,
with no gap and no duplicate (``tidegate.event_feed.follow``), and closes with 1000 after the
final event. A watcher shows the owner's ``Authorization: Bearer <key>`` or the job's
``?token=<stream_token>`` (``tidegate.auth``). Close codes: 4401 no or unknown credentials,
4403 another tenant's key or a wrong token, 4404 unknown job, 4400 bad query, 1013 Redis
unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tidegate.auth import Auth, AuthError, job_access
from tidegate.event_feed import follow
from tidegate.redis_conn import connect
from tidegate.settings import Settings

CLOSE_DONE = 1000
CLOSE_TRY_AGAIN = 1013
CLOSE_BAD_REQUEST = 4400
CLOSE_UNKNOWN_JOB = 4404


class Gateway:
    """The gateway's routes and the Redis client and auth they share."""

    def __init__(self, settings: Settings, *, auth: Auth | None = None):
        self.settings = settings
        self.auth = auth if auth is not None else Auth.from_settings(settings)
        self._redis: aioredis.Redis | None = None
        self.routes: list[BaseRoute] = [
            WebSocketRoute("/v1/jobs/{job_id}/stream", self.stream),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]

    async def start(self) -> None:
        self.auth.start()
        self._redis = connect(self.settings.redis_url)

    async def stop(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def stream(self, ws: WebSocket) -> None:
        """Relay one job's events to one client, then close."""
        await ws.accept()
        job_id = ws.path_params["job_id"]
        after_id = _after_id(ws.query_params.get("last_event_id"))
        if after_id is None:
            return await _close(ws, CLOSE_BAD_REQUEST, "last_event_id must be an integer >= 0")
        try:
            if not await self._may_watch(ws, job_id):
                return await _close(ws, CLOSE_UNKNOWN_JOB, "unknown job")
            finished = await self._relay(ws, job_id, after_id)
        except AuthError as exc:
            return await _close(ws, exc.close_code, str(exc))
        except RedisError:
            return await _close(ws, CLOSE_TRY_AGAIN, "the event store is unavailable")
        if finished:
            await _close(ws, CLOSE_DONE, "done")

    async def _may_watch(self, ws: WebSocket, job_id: str) -> bool:
        """False for an unknown job; ``AuthError`` if this client may not watch it."""
        authorization, token = ws.headers.get("authorization"), ws.query_params.get("token")
        if token is None:
            self.auth.tenant(authorization)  # no credentials: 4401 before the job is looked up
        access = await job_access(self._connected(), job_id)
        if access is None:
            return False
        self.auth.check_stream(access, authorization=authorization, token=token)
        return True

    async def _relay(self, ws: WebSocket, job_id: str, after_id: int) -> bool:
        """Send events until the final one (True) or until the client leaves (False).

        Waiting for the client's disconnect beside the relay is what frees the subscription
        of a client that leaves while the job is quiet (queued), not only mid-stream.
        """
        sender = asyncio.create_task(self._send_events(ws, job_id, after_id))
        listener = asyncio.create_task(_until_disconnect(ws))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A plain task cancel (not a level-triggered cancel scope) lets follow()'s
            # cleanup await the release of its pub/sub connection.
            sender.cancel()
            listener.cancel()
            await asyncio.wait({sender, listener})
        if not listener.cancelled():
            listener.exception()  # retrieved: a broken receive channel only means "gone"
        if sender.cancelled():
            return False
        return sender.result()

    async def _send_events(self, ws: WebSocket, job_id: str, after_id: int) -> bool:
        try:
            async with contextlib.aclosing(follow(self._connected(), job_id, after_id=after_id)) as feed:
                async for event in feed:
                    await ws.send_text(event.raw)
        except WebSocketDisconnect:
            return False
        return True

    def _connected(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("Gateway.start() was not called")
        return self._redis


def create_app(settings: Settings) -> Starlette:
    """The gateway alone (``tidegate gateway``)."""
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    return Starlette(routes=gateway.routes, lifespan=lifespan)


def _after_id(raw: str | None) -> int | None:
    """The ``last_event_id`` query parameter: 0 when absent, None when malformed."""
    if raw is None:
        return 0
    return int(raw) if raw.isdigit() and len(raw) <= 18 else None


async def _until_disconnect(ws: WebSocket) -> None:
    while (await ws.receive())["type"] != "websocket.disconnect":
        pass  # nothing a client sends means anything here


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await ws.close(code, reason)  # the client may already be gone
