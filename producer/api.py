"""The HTTP API producers submit jobs to: validate, admit, enqueue, answer where to stream.

Nothing reaches Redis until a request has passed validation and admission, and every error is
one JSON shape naming the fields at fault (``producer.errors.error_body``). ``ProducerAPI``
holds the routes and what they share, so ``tidegate up`` can mount them beside the gateway.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from producer.admission import Admission, AdmissionError
from producer.errors import FieldError, error_body, field_errors
from tidegate import keys
from tidegate.jobstore import enqueue, read_result
from tidegate.protocol import JobRequest
from tidegate.redis_conn import connect
from tidegate.settings import Settings

# Far above any admissible prompt (1M characters, escaped); refused before it is buffered.
MAX_BODY_BYTES = 16 * 1024 * 1024


class Refusal(Exception):
    """An error response, raised anywhere in a handler and rendered in one place."""

    def __init__(self, status: int, type: str, message: str, fields: list[FieldError] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.fields = status, type, message, fields

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.type, self.message, self.fields), self.status)


class ProducerAPI:
    """The producer API's routes and the Redis client and admission they share."""

    def __init__(self, settings: Settings, *, admission: Admission | None = None):
        self.settings = settings
        self._admission = admission  # None: loaded from settings.model by start()
        self._redis: aioredis.Redis | None = None
        self.routes: list[BaseRoute] = [
            Route("/v1/jobs", self.submit, methods=["POST"]),
            Route("/v1/jobs/{job_id}", self.get_job, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]
        # Routing errors (404 no route, 405) in the same JSON shape; pass to the app.
        self.exception_handlers: Mapping[Any, Any] = {
            HTTPException: _http_exception, Exception: _internal_error}

    async def start(self) -> None:
        """Load the tokenizer (if none was given) and open the Redis client."""
        if self._admission is None:
            self._admission = await anyio.to_thread.run_sync(
                Admission.for_model, self.settings.model)
        self._redis = connect(self.settings.redis_url)

    async def stop(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def submit(self, request: Request) -> Response:
        """``POST /v1/jobs``: 202 with the job id and its stream URL."""
        try:
            job_request = _validated(await _read_json(request))
            job_request = await self._admit(job_request)
            job = job_request.to_job(default_timeout_s=self.settings.default_timeout_s)
            await enqueue(self._connected(), job, ttl_s=self.settings.job_ttl_s)
        except Refusal as refusal:
            return refusal.response()
        except RedisError as exc:
            return _unavailable(exc).response()
        body = {"id": job.id, "stream_url": self._stream_url(request, job.id), "status": "queued"}
        return JSONResponse(body, 202, headers={"Location": f"/v1/jobs/{job.id}"})

    async def get_job(self, request: Request) -> Response:
        """``GET /v1/jobs/{id}``: the job's status and, once finished, its result."""
        job_id = request.path_params["job_id"]
        if not keys.is_valid_job_id(job_id):
            return _not_found(job_id).response()
        try:
            result = await read_result(self._connected(), job_id)
        except RedisError as exc:
            return _unavailable(exc).response()
        if result is None:
            return _not_found(job_id).response()
        return Response(result.model_dump_json(), media_type="application/json")

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _admit(self, job_request: JobRequest) -> JobRequest:
        if self._admission is None:
            raise RuntimeError("ProducerAPI.start() was not called")
        try:
            return await anyio.to_thread.run_sync(self._admission.check, job_request)
        except AdmissionError as exc:
            fields = [FieldError(field=exc.field, reason=exc.reason)]
            raise Refusal(422, exc.type, str(exc), fields) from exc

    def _connected(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("ProducerAPI.start() was not called")
        return self._redis

    def _stream_url(self, request: Request, job_id: str) -> str:
        base = self.settings.gateway_url or _ws_base(request)
        return f"{base.rstrip('/')}/v1/jobs/{job_id}/stream"


def create_app(settings: Settings, *, admission: Admission | None = None) -> Starlette:
    """The producer API alone (``tidegate api``)."""
    api = ProducerAPI(settings, admission=admission)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await api.start()
        try:
            yield
        finally:
            await api.stop()

    return Starlette(routes=api.routes, lifespan=lifespan,
                     exception_handlers=dict(api.exception_handlers))


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect as exc:  # nobody will read the answer; just don't log a traceback
        raise Refusal(400, "client_disconnected", "the client left mid-body") from exc
    try:
        return json.loads(b"".join(chunks))
    except ValueError as exc:  # includes a body that is not UTF-8
        fields = [FieldError(field="body", reason=str(exc))]
        raise Refusal(400, "invalid_json", "the request body is not valid JSON", fields) from exc


def _validated(body: Any) -> JobRequest:
    try:
        return JobRequest.model_validate(body)
    except ValidationError as exc:
        fields = field_errors(exc)
        message = "; ".join(f"{f['field']}: {f['reason']}" for f in fields)
        raise Refusal(422, "invalid_request", message, fields) from exc


def _too_large() -> Refusal:
    return Refusal(413, "request_too_large", f"the request body exceeds {MAX_BODY_BYTES} bytes")


def _not_found(job_id: str) -> Refusal:
    return Refusal(404, "not_found", f"no job with id {job_id!r}")


def _unavailable(exc: RedisError) -> Refusal:
    message = f"the job store is unavailable ({type(exc).__name__}); retry later"
    return Refusal(503, "service_unavailable", message)


def _ws_base(request: Request) -> str:
    """The request's own base URL with the WebSocket scheme (API and gateway share a port)."""
    base = str(request.base_url)
    return "wss" + base[len("https"):] if base.startswith("https") else "ws" + base[len("http"):]


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(error_body(kind, str(exc.detail)), exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this, so the traceback is logged; the client gets JSON only.
    return JSONResponse(error_body("internal_error", "internal server error"), 500)
