"""The HTTP API producers submit jobs to: authenticate, validate, admit, enqueue, answer where
to stream; read a job back; cancel it.

Nothing reaches Redis until a request has passed validation and admission, and every error is
one JSON shape naming the fields at fault (``producer.errors.error_body``). ``ProducerAPI``
holds the routes and what they share, so ``tidegate up`` can mount them beside the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from producer.errors import FieldError, error_body, field_errors
from producer.openapi_paths import producer_docs
from producer.socket_submit import SocketSubmit
from producer.submit import idempotency
from producer.submit.admission import Admission, AdmissionError
from producer.submit.backlog import LaneBacklog, LaneFull
from producer.submit.idempotency import Claim, ClaimInProgress
from producer.submit.rate_limit import RateLimiter
from producer.submit.refusal import Refusal, refusal_of
from tidegate import untrusted_json
from tidegate.events.event_hub import EventHub
from tidegate.http.auth import Auth, AuthError, job_access, new_stream_token, token_hash
from tidegate.http.openapi import openapi_route
from tidegate.jobstore import enqueue, read_result, request_cancel
from tidegate.operations.operator_routes import metrics_response, readiness_response
from tidegate.protocol import Job, JobRequest
from tidegate.redis_conn import connect
from tidegate.settings import Settings

# Far above any admissible prompt (1M characters, escaped); refused before it is buffered.
MAX_BODY_BYTES = 16 * 1024 * 1024


class ProducerAPI:
    """The producer API's routes and the Redis client, auth, admission and backlog they share."""

    def __init__(self, settings: Settings, *, admission: Admission | None = None,
                 auth: Auth | None = None):
        self.settings = settings
        self.auth = auth if auth is not None else Auth.from_settings(settings)
        self._admission = admission  # None: loaded from settings.model by start()
        self.limiter = RateLimiter.from_settings(settings, self.auth)
        self._backlog = LaneBacklog(max_backlog=settings.max_backlog,
                                    partitions=settings.lane_partitions,
                                    retry_after_s=settings.retry_after_s)
        self._redis: aioredis.Redis | None = None
        self._batched: Batched | None = None  # the client for the submit path's commands
        self._hub: EventHub | None = None
        # Stream URL bases by what they are made of (see _base_key): building one from the
        # request (Starlette's base_url) cost more than the rest of the answer.
        self._stream_base: dict[tuple[Any, ...], str] = {}
        self.routes: list[BaseRoute] = [
            Route("/v1/jobs", self.submit, methods=["POST"]),
            Route("/v1/jobs/{job_id}", self.get_job, methods=["GET"]),
            Route("/v1/jobs/{job_id}/cancel", self.cancel, methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        # Routing errors (404 no route, 405) in the same JSON shape; pass to the app.
        self.exception_handlers: Mapping[Any, Any] = {
            HTTPException: _http_exception, Exception: _internal_error}
        # --- OpenAI-compatible routes (producer/openai_compat/routes.py), sharing this API's auth,
        # admission and enqueue. Imported here because that module imports this one.
        from producer.openai_compat.routes import OpenAIRoutes

        self.routes += OpenAIRoutes(self).routes
        self.routes += SocketSubmit(self).routes

    async def start(self) -> None:
        """Load the tokenizer (if none was given) and open the Redis client."""
        self.auth.start()
        if self._admission is None:
            self._admission = await anyio.to_thread.run_sync(
                Admission.for_model, self.settings.model, self.settings.max_output_tokens)
        self._redis = connect(self.settings.redis_url)
        self._batched = Batched(self._redis)
        self._hub = EventHub(self._redis, queue_size=self.settings.watcher_queue_size,
                             backlog_bytes=self.settings.watcher_backlog_bytes)
        await self._hub.start()

    async def stop(self) -> None:
        if self._batched is not None:
            await self._batched.close()
            self._batched = None
        if self._hub is not None:
            await self._hub.stop()
            self._hub = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def submit(self, request: Request) -> Response:
        """``POST /v1/jobs``: 202 with the job's id, stream URL and stream token (200 with the
        same answer for a repeat of an earlier submit's ``Idempotency-Key``)."""
        return await _answer(self._submit(request))

    async def get_job(self, request: Request) -> Response:
        """``GET /v1/jobs/{id}``: the job's status and, once finished, its result."""
        return await _answer(self._get_job(request))

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/jobs/{id}/cancel``: 202 ``cancelled`` (it was queued) or ``cancelling``
        (its worker stops it within a step); 409 if it had already finished."""
        return await _answer(self._cancel(request))

    async def submit_job(self, job_request: JobRequest, *, tenant: str,
                         rate_headers: dict[str, str] | None = None) -> Job:
        """Admit a validated request, check its lane's backlog and ``tenant``'s rate limits and
        enqueue its job: what every submit route does. Raises ``Refusal`` (admission,
        ``RateLimited``), ``LaneFull`` or ``RedisError``. ``rate_headers`` receives the
        ``x-ratelimit-*`` headers for the answer."""
        job = await self._admitted_job(job_request, tenant, rate_headers)
        await self._enqueue(job, tenant=tenant)
        return job

    async def _submit(self, request: Request) -> Response:
        tenant = self.auth.tenant(request.headers.get("authorization"))
        body = _with_header_key(await _read_json(request), request.headers.get("idempotency-key"))
        rate_headers: dict[str, str] = {}
        claim, status, code = await self.accept(tenant, body, rate_headers=rate_headers)
        return self._accepted(request, claim, status, code, rate_headers)

    async def accept(self, tenant: str, body: Any, *,
                     rate_headers: dict[str, str] | None = None) -> tuple[Claim, str, int]:
        """Validate, admit and enqueue a submitted body for ``tenant``: (claim, status, 202),
        or the earlier job's (claim, status, 200) for a repeated ``idempotency_key`` (not
        charged to the rate limits: a retry of a job already made). ``rate_headers`` as for
        ``submit_job``.

        Raises ``Refusal``, ``LaneFull``, ``ClaimInProgress`` or ``RedisError``; ``refusal_of``
        turns each into the API's error.
        """
        job_request = _validated(body)
        key = job_request.idempotency_key
        redis = self._submit_redis()
        if key is not None and (earlier := await idempotency.replay(redis, tenant, key)):
            return earlier.claim, earlier.status, 200
        job = await self._admitted_job(job_request, tenant, rate_headers)
        claim = Claim(job_id=job.id, stream_token=new_stream_token(), created_ms=job.created_ms)
        if key is not None and not await idempotency.claim(
                redis, tenant, key, claim, ttl_s=self.settings.idempotency_ttl_s):
            twin = await idempotency.replay(redis, tenant, key)  # the concurrent submit's
            if twin is None:
                raise ClaimInProgress("a submit with this idempotency key failed just now; retry")
            return twin.claim, twin.status, 200
        try:
            await self._enqueue(job, tenant=tenant, stream_token=claim.stream_token)
        except BaseException:  # whatever failed (a cancel included), a retry may enqueue it
            if key is not None:
                with contextlib.suppress(RedisError):
                    await idempotency.release(redis, tenant, key, claim)
            raise
        return claim, "queued", 202

    async def _admitted_job(self, job_request: JobRequest, tenant: str,
                            rate_headers: dict[str, str] | None) -> Job:
        """The job to enqueue, once admission, the lane's backlog and the tenant's rate limits
        allow it (charged last: a submit refused for any other reason costs nothing)."""
        job_request, prompt_tokens = await self._admit(job_request)
        await self._backlog.check(self._connected(), job_request.lane)
        rate = await self.limiter.charge(self._submit_redis(), tenant,
                                         prompt_tokens=prompt_tokens,
                                         max_tokens=job_request.max_tokens)
        if rate is not None and rate_headers is not None:
            rate_headers.update(rate.headers())
        return job_request.to_job(default_timeout_s=self.settings.default_timeout_s)

    async def _enqueue(self, job: Job, *, tenant: str, stream_token: str | None = None) -> None:
        hashed = token_hash(stream_token) if stream_token is not None else None
        # A fresh job id (uuid4) has no record yet, so this always enqueues. Batched stands in
        # for the client: enqueue sends one EVALSHA (or SCRIPT LOAD first, straight through).
        await enqueue(self._submit_redis(), job,  # type: ignore[arg-type]
                      ttl_s=self.settings.job_ttl_s, owner=tenant, stream_token_hash=hashed)
        self._backlog.note_enqueued(job.lane)

    async def _get_job(self, request: Request) -> Response:
        job_id = await self._authorized_job(request)
        result = await read_result(self._connected(), job_id)
        if result is None:  # expired between the two reads
            raise _not_found(job_id)
        return Response(result.model_dump_json(), media_type="application/json")

    async def _cancel(self, request: Request) -> Response:
        job_id = await self._authorized_job(request)
        outcome = await request_cancel(self._connected(), job_id,
                                       ttl_s=self.settings.cancelled_ttl_s)
        if outcome in ("cancelled", "cancelling"):
            return JSONResponse({"id": job_id, "status": outcome}, 202)
        if outcome == "missing":
            raise _not_found(job_id)
        raise Refusal(409, "conflict", f"job {job_id!r} already finished ({outcome})",
                      extra={"status": outcome})

    async def _authorized_job(self, request: Request) -> str:
        """The path's job id, once the caller is known (401) and owns the job (404, 403)."""
        tenant = self.auth.tenant(request.headers.get("authorization"))
        job_id = request.path_params["job_id"]
        access = await job_access(self._connected(), job_id)
        if access is None:
            raise _not_found(job_id)
        self.auth.check_owner(tenant, access)
        return job_id

    def _accepted(self, request: Request, claim: Claim, status: str, code: int,
                  headers: Mapping[str, str]) -> Response:
        body = {"id": claim.job_id, "stream_url": self._stream_url(request, claim.job_id),
                "status": status, "stream_token": claim.stream_token}
        return JSONResponse(body, code,
                            headers={"Location": f"/v1/jobs/{claim.job_id}", **headers})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        """Ready: started (tokenizer loaded for admission) and Redis answers."""
        if self._admission is None or self._redis is None:
            return JSONResponse({"ready": False, "reason": "starting"}, 503)
        return await readiness_response(self._redis)

    async def metrics(self, request: Request) -> Response:
        """Prometheus: the queue per lane, the live workers and this process's rate-limit
        refusals by tenant id (no key: scrapers hold none; nothing here names a job)."""
        return await metrics_response(self._connected(), self.settings.lane_partitions,
                                      collectors=[self.limiter])

    async def _admit(self, job_request: JobRequest) -> tuple[JobRequest, int]:
        """The request as admitted, and its prompt's token count."""
        if self._admission is None:
            raise RuntimeError("ProducerAPI.start() was not called")
        try:
            if self._admission.is_quick(job_request):
                return self._admission.admit(job_request)
            return await anyio.to_thread.run_sync(self._admission.admit, job_request)
        except AdmissionError as exc:
            fields = [FieldError(field=exc.field, reason=exc.reason)]
            raise Refusal(422, exc.type, str(exc), fields) from exc

    def _connected(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("ProducerAPI.start() was not called")
        return self._redis

    def _submit_redis(self) -> Batched:
        if self._batched is None:
            raise RuntimeError("ProducerAPI.start() was not called")
        return self._batched

    @property
    def redis(self) -> aioredis.Redis:
        return self._connected()

    @property
    def hub(self) -> EventHub:
        """Multiplexes the watchers of ``/v1/stream`` over one pub/sub connection."""
        if self._hub is None:
            raise RuntimeError("ProducerAPI.start() was not called")
        return self._hub

    def _stream_url(self, request: Request, job_id: str) -> str:
        base = self._stream_base.get(_base_key(request.scope))
        if base is None:
            base = (self.settings.gateway_url or _ws_base(request)).rstrip("/")
            if len(self._stream_base) < 256:  # Host headers are the client's: bound the cache
                self._stream_base[_base_key(request.scope)] = base
        return f"{base}/v1/jobs/{job_id}/stream"


class Batched:
    """The Redis client as the submit path uses it: the commands that concurrent submits make
    (GET, SET, HGET, EVALSHA) go to Redis together, in one pipeline.

    What a round trip costs this process in redis-py (a pooled connection, a write, a read:
    about 100 us of CPU) is paid once per pipeline instead of once per command: while one
    pipeline is on its way, the commands made meanwhile wait for the next, so a lone command
    goes at once and a busy API sends dozens per round trip. Each caller still gets its own
    command's answer (or error) only once Redis has run it, exactly as from the client; a
    pipeline is no transaction, so each command is what it was alone (an enqueue is still its
    one atomic script). Any other command goes straight to the client. (Redis Cluster: a
    pipeline may mix slots, redis-py's cluster pipeline splits it by node.)
    """

    def __init__(self, redis: aioredis.Redis):
        self._redis = redis
        self._waiting: list[_Command] = []
        self._sender: asyncio.Task[None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("get", args, kwargs)

    async def set(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("set", args, kwargs)

    async def hget(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("hget", args, kwargs)

    async def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("evalsha", args, kwargs)

    async def close(self) -> None:
        """Wait for what is on its way (the server stops taking requests first)."""
        if self._sender is not None:
            await asyncio.shield(self._sender)

    async def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        command = _Command(method, args, kwargs, loop.create_future())
        self._waiting.append(command)
        if self._sender is None:
            self._sender = loop.create_task(self._send_all())
        return await command.answer

    async def _send_all(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    await self._send(batch)
                except BaseException as exc:  # a bug or a cancellation: no caller waits forever
                    for command in batch:
                        command.fail(exc if isinstance(exc, Exception) else
                                     RedisError("the API is shutting down"))
                    raise
        finally:
            self._sender = None
            for command in self._waiting:  # only after a cancellation: the loop empties it
                command.fail(RedisError("the API is shutting down"))
            self._waiting = []

    async def _send(self, batch: list[_Command]) -> None:
        if len(batch) == 1:
            command = batch[0]
            try:
                answer = await getattr(self._redis, command.method)(*command.args,
                                                                    **command.kwargs)
            except RedisError as exc:
                command.fail(exc)
            else:
                command.succeed(answer)
            return
        pipe = self._redis.pipeline(transaction=False)
        for command in batch:
            getattr(pipe, command.method)(*command.args, **command.kwargs)
        try:
            answers = await pipe.execute(raise_on_error=False)
        except RedisError as exc:
            for command in batch:
                command.fail(exc)
            return
        for command, answer in zip(batch, answers, strict=True):
            if isinstance(answer, Exception):
                command.fail(answer)
            else:
                command.succeed(answer)


class _Command:
    """One caller's command and the future it awaits."""

    __slots__ = ("answer", "args", "kwargs", "method")

    def __init__(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 answer: asyncio.Future[Any]):
        self.method, self.args, self.kwargs, self.answer = method, args, kwargs, answer

    def succeed(self, answer: Any) -> None:
        if not self.answer.done():  # a caller cancelled meanwhile (its client left) has gone
            self.answer.set_result(answer)

    def fail(self, exc: BaseException) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


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

    routes = [*api.routes, openapi_route(producer_docs(), title="tidegate API")]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers=dict(api.exception_handlers))


async def _answer(handling: Awaitable[Response]) -> Response:
    """A handler's response, or the one JSON error shape for whatever refusal it raised."""
    try:
        return await handling
    except (Refusal, AuthError, LaneFull, ClaimInProgress, RedisError) as exc:
        return refusal_of(exc).response()


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length", "")
    # ASCII digits only: "²".isdigit() is true and int() refuses it (the server checks the
    # header's syntax itself; this is only the early refusal of a body too large).
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    # The ASGI messages themselves, as Request.stream() reads them, without its generator.
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":  # nobody will read the answer; no traceback
            raise Refusal(400, "client_disconnected", "the client left mid-body")
        if message["type"] != "http.request":
            continue
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    try:
        return untrusted_json.parse(chunks[0] if len(chunks) == 1 else b"".join(chunks))
    except untrusted_json.BadJSON as exc:  # not JSON, not UTF-8, too deep, a lone surrogate
        fields = [FieldError(field=exc.field, reason=exc.reason)]
        message = ("the request body is not valid JSON" if exc.field == "body" else str(exc))
        raise Refusal(400, "invalid_json", message, fields) from exc


def _with_header_key(body: Any, header: str | None) -> Any:
    """The body with the ``Idempotency-Key`` header as its ``idempotency_key`` (validated
    with the body); 422 if the body names a different key."""
    if header is None or not isinstance(body, dict):
        return body
    if body.get("idempotency_key", header) != header:
        fields = [FieldError(field="idempotency_key",
                             reason="differs from the Idempotency-Key header")]
        raise Refusal(422, "invalid_request", "idempotency_key: differs from the "
                      "Idempotency-Key header", fields)
    return {**body, "idempotency_key": header}


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


def _base_key(scope: Mapping[str, Any]) -> tuple[Any, ...]:
    """Everything Starlette's ``request.base_url`` is made of."""
    host = next((value for key, value in scope["headers"] if key == b"host"), None)
    return (scope.get("scheme"), host, scope.get("server"),
            scope.get("app_root_path", scope.get("root_path", "")))


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
