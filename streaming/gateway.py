"""The gateway: every event of a job relayed from Redis to each client watching it.

Routes:
* ``WS /v1/jobs/{id}/stream[?last_event_id=N]``: the job's events after N (all when absent),
  then live ones, no gap and no duplicate; protocol and close codes in ``tidegate.events.ws_relay``.
* ``GET /v1/jobs/{id}/events``: the same as Server-Sent Events (``id:`` is the event id, so a
  browser's ``EventSource`` resumes by itself with ``Last-Event-ID``).
* ``GET /v1/queue``: queue depth per lane, running jobs, live workers, tokens/s.
* ``GET /``: the live web page (``streaming/static``).
* ``GET /healthz``.

A watcher shows the owner's ``Authorization: Bearer <key>`` or the job's ``?token=<stream
token>`` (``tidegate.http.auth``). One ``EventHub`` per process multiplexes every watcher over a
single Redis pub/sub connection; each watcher has a bounded queue, and one that falls further
behind is cut (1013 / end of the SSE stream) without slowing anyone else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client.registry import Collector
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from tidegate.events.event_hub import EventHub, Lagging
from tidegate.events.ws_relay import (
    CLOSE_BAD_REQUEST,
    CLOSE_TRY_AGAIN,
    CLOSE_UNKNOWN_JOB,
    MAX_RESUME_ID,
    close,
    relay,
)
from tidegate.http.auth import Auth, AuthError, job_access
from tidegate.http.openapi import openapi_route
from tidegate.operations.metric_doc import MetricDoc
from tidegate.operations.operator_routes import metrics_response, readiness_response
from tidegate.operations.queue_stats import queue_stats
from tidegate.redis_conn import connect
from tidegate.settings import Settings
from tidegate.streaming.openapi_paths import gateway_docs

STATIC = Path(__file__).with_name("static")
SSE_KEEPALIVE_S = 15.0
WATCHERS = MetricDoc("tidegate_gateway_watchers", "gauge",
                     "Clients watching a job on this process.")
WATCHED_JOBS = MetricDoc("tidegate_gateway_watched_jobs", "gauge",
                         "Jobs this process is subscribed to.")
DIRECT_SENDS = MetricDoc("tidegate_gateway_direct_sends", "gauge",
                         "Events written straight to idle watchers' sockets since start.")
GATEWAY_METRICS = (WATCHERS, WATCHED_JOBS, DIRECT_SENDS)
BAD_RESUME_POINT = f"last_event_id (or Last-Event-ID) must be an integer from 0 to {MAX_RESUME_ID}"


class Gateway:
    """The gateway's routes and the Redis client, event hub and auth they share."""

    def __init__(self, settings: Settings, *, auth: Auth | None = None,
                 collectors: Sequence[Collector] = ()):
        """``collectors``: more of this process's counters for its /metrics (``tidegate up``
        serves the API's there)."""
        self.settings = settings
        self.collectors = list(collectors)
        self.auth = auth if auth is not None else Auth.from_settings(settings)
        self._redis: aioredis.Redis | None = None
        self._hub: EventHub | None = None
        self.routes: list[BaseRoute] = [
            WebSocketRoute("/v1/jobs/{job_id}/stream", self.stream),
            Route("/v1/jobs/{job_id}/events", self.events, methods=["GET"]),
            Route("/v1/queue", self.queue, methods=["GET"]),
            Route("/", self.page, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    @property
    def hub(self) -> EventHub:
        if self._hub is None:
            raise RuntimeError("Gateway.start() was not called")
        return self._hub

    async def start(self) -> None:
        self.auth.start()
        self._redis = connect(self.settings.redis_url)
        self._hub = EventHub(self._redis, queue_size=self.settings.watcher_queue_size,
                             backlog_bytes=self.settings.watcher_backlog_bytes)
        await self._hub.start()

    async def stop(self) -> None:
        if self._hub is not None:
            await self._hub.stop()
            self._hub = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """Ready: started and Redis answers."""
        if self._redis is None or self._hub is None:
            return JSONResponse({"ready": False, "reason": "starting"}, 503)
        return await readiness_response(self._redis)

    async def metrics(self, request: Request) -> Response:
        """Prometheus: the queue, plus this process's watchers (no key, no job names)."""
        hub = self.hub
        return await metrics_response(self._connected(), self.settings.lane_partitions, {
            WATCHERS: hub.watchers, WATCHED_JOBS: hub.watched_jobs,
            DIRECT_SENDS: hub.direct_sends}, collectors=self.collectors)

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def queue(self, request: Request) -> Response:
        """``GET /v1/queue``: the live queue (any valid key when auth is on)."""
        try:
            self.auth.tenant(request.headers.get("authorization"))
            stats = await queue_stats(self._connected(), self.settings.lane_partitions)
        except AuthError as exc:
            return _error(exc.status, exc.type, str(exc))
        except RedisError:
            return _error(503, "unavailable", "the queue store is unavailable")
        return JSONResponse(stats.to_dict(), headers={"Cache-Control": "no-store"})

    async def stream(self, ws: WebSocket) -> None:
        """Relay one job's events to one WebSocket client, then close."""
        await ws.accept()
        job_id = ws.path_params["job_id"]
        after_id = resume_point(ws.query_params.get("last_event_id"))
        if after_id is None:
            return await close(ws, CLOSE_BAD_REQUEST, BAD_RESUME_POINT)
        try:
            if not await self._may_watch(ws.headers.get("authorization"),
                                         ws.query_params.get("token"), job_id):
                return await close(ws, CLOSE_UNKNOWN_JOB, "unknown job")
            await relay(ws, self.hub, job_id, after_id)
        except AuthError as exc:
            return await close(ws, exc.close_code, str(exc))
        except RedisError:
            return await close(ws, CLOSE_TRY_AGAIN, "the event store is unavailable")

    async def events(self, request: Request) -> Response:
        """``GET /v1/jobs/{id}/events``: Server-Sent Events, resuming after ``Last-Event-ID``."""
        job_id = request.path_params["job_id"]
        raw = request.headers.get("last-event-id", request.query_params.get("last_event_id"))
        after_id = resume_point(raw)
        if after_id is None:
            return _error(400, "invalid_request", BAD_RESUME_POINT, field="last_event_id")
        try:
            if not await self._may_watch(request.headers.get("authorization"),
                                         request.query_params.get("token"), job_id):
                return _error(404, "not_found", f"no job {job_id!r}")
        except AuthError as exc:
            return _error(exc.status, exc.type, str(exc))
        except RedisError:
            return _error(503, "unavailable", "the event store is unavailable")
        return StreamingResponse(
            self._sse(job_id, after_id), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse(self, job_id: str, after_id: int) -> AsyncIterator[str]:
        # ``retry`` tells EventSource how soon to come back after a cut (lagging, restart).
        yield "retry: 1000\n\n"
        try:
            async with self.hub.watch(job_id, after_id) as watch:
                while not watch.finished:
                    event = await watch.next(timeout=SSE_KEEPALIVE_S)
                    if event is None:
                        yield ": keepalive\n\n"  # a comment: keeps proxies from timing out
                    else:
                        yield f"id: {event.id}\ndata: {event.raw}\n\n"
        except StopAsyncIteration:
            return  # resumed after the final event
        except (Lagging, RedisError):
            return  # the client reconnects with Last-Event-ID and resumes exactly

    async def _may_watch(self, authorization: str | None, token: str | None,
                         job_id: str) -> bool:
        """False for an unknown job; ``AuthError`` if this client may not watch it."""
        if token is None:
            self.auth.tenant(authorization)  # no credentials: 401 before the job is looked up
        access = await job_access(self._connected(), job_id)
        if access is None:
            return False
        self.auth.check_stream(access, authorization=authorization, token=token)
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

    routes = [*gateway.routes, openapi_route(gateway_docs(), title="tidegate gateway")]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return app


def resume_point(raw: str | None) -> int | None:
    """A ``last_event_id``: 0 when absent, None when malformed (anything but 1 to 18 ASCII
    digits: ``"²".isdigit()`` is true, yet ``int("²")`` raises)."""
    if raw is None or raw == "":
        return 0
    if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(MAX_RESUME_ID))):
        return None
    return int(raw)


def _error(status: int, type: str, message: str, *, field: str | None = None) -> JSONResponse:
    """The API's error shape: ``{"error": {"type", "message", "fields": [{field, reason}]}}``."""
    fields = [{"field": field, "reason": message}] if field is not None else []
    return JSONResponse({"error": {"type": type, "message": message, "fields": fields}}, status)

