"""The HTTP API producers submit jobs to: authenticate, validate, admit, enqueue, answer where
to stream; read a job back; cancel it; register LoRA adapters.

Nothing reaches Redis until a request has passed validation and admission
(``tidegate.producer.submit.submit_path``, the path every submit route shares), and every error is one
JSON shape naming the fields at fault (``tidegate.producer.errors.error_body``). ``ProducerAPI`` holds
the routes, so ``tidegate up`` can mount them beside the gateway, and runs the sweeper that
rejects the expired jobs of models no worker serves (``tidegate.producer.no_worker_sweeper``)
and warns when live workers serve models this API was not given
(``tidegate.producer.model_agreement``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tidegate.http.auth import Auth, job_access
from tidegate.http.openapi import openapi_route
from tidegate.jobstore import read_result, request_cancel
from tidegate.operations.operator_routes import metrics_response, readiness_response
from tidegate.operations.queue_stats import WorkerStats
from tidegate.producer.adapter_routes import AdapterRoutes
from tidegate.producer.errors import error_body
from tidegate.producer.model_agreement import ModelAgreement
from tidegate.producer.no_worker_sweeper import NoWorkerSweeper
from tidegate.producer.openai_compat.routes import OpenAIRoutes
from tidegate.producer.openapi_paths import producer_docs
from tidegate.producer.socket_submit import SocketSubmit
from tidegate.producer.submit.admission import Admission
from tidegate.producer.submit.idempotency import Claim
from tidegate.producer.submit.refusal import Refusal, answer
from tidegate.producer.submit.request_body import read_json, with_header_key
from tidegate.producer.submit.submit_path import SubmitPath
from tidegate.settings import Settings

log = logging.getLogger("tidegate.api")


class ProducerAPI:
    """The producer API's routes: the native job routes, the OpenAI routes and the socket
    submit, all over one ``SubmitPath``."""

    def __init__(self, settings: Settings, *, admission: Admission | None = None,
                 auth: Auth | None = None):
        self.settings = settings
        self.path = SubmitPath(settings, admission=admission, auth=auth)
        self.auth = self.path.auth
        self._sweeper: NoWorkerSweeper | None = None
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
            *OpenAIRoutes(self.path).routes,
            *AdapterRoutes(self.path).routes,
            *SocketSubmit(self.path).routes,
        ]
        # Routing errors (404 no route, 405) in the same JSON shape; pass to the app.
        self.exception_handlers: Mapping[Any, Any] = {
            HTTPException: _http_exception, Exception: _internal_error}

    async def start(self) -> None:
        """Load the tokenizers (those not given), open the Redis client, start the sweeper."""
        await self.path.start()
        agreement = ModelAgreement(self.path.catalog.names)

        def check_agreement(workers: list[WorkerStats]) -> None:
            warning = agreement.observe(w.model for w in workers)
            if warning is not None:
                log.warning(warning)

        self._sweeper = NoWorkerSweeper(self.path.redis, self.path.catalog.names,
                                        partitions=self.settings.lane_partitions,
                                        rejected_ttl_s=self.settings.rejected_ttl_s,
                                        on_workers=check_agreement)
        self._sweeper.start()

    async def stop(self) -> None:
        if self._sweeper is not None:
            await self._sweeper.stop()
            self._sweeper = None
        await self.path.stop()

    async def submit(self, request: Request) -> Response:
        """``POST /v1/jobs``: 202 with the job's id, stream URL and stream token (200 with the
        same answer for a repeat of an earlier submit's ``Idempotency-Key``)."""
        return await answer(self._submit(request))

    async def get_job(self, request: Request) -> Response:
        """``GET /v1/jobs/{id}``: the job's status and, once finished, its result."""
        return await answer(self._get_job(request))

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/jobs/{id}/cancel``: 202 ``cancelled`` (it was queued) or ``cancelling``
        (its worker stops it within a step); 409 if it had already finished."""
        return await answer(self._cancel(request))

    async def _submit(self, request: Request) -> Response:
        tenant = self.auth.tenant(request.headers.get("authorization"))
        body = with_header_key(await read_json(request), request.headers.get("idempotency-key"))
        rate_headers: dict[str, str] = {}
        claim, status, code = await self.path.accept(tenant, body, rate_headers=rate_headers)
        return self._accepted(request, claim, status, code, rate_headers)

    async def _get_job(self, request: Request) -> Response:
        job_id = await self._authorized_job(request)
        result = await read_result(self.path.redis, job_id)
        if result is None:  # expired between the two reads
            raise _not_found(job_id)
        return Response(result.model_dump_json(), media_type="application/json")

    async def _cancel(self, request: Request) -> Response:
        job_id = await self._authorized_job(request)
        outcome = await request_cancel(self.path.redis, job_id,
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
        access = await job_access(self.path.redis, job_id)
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
        if not self.path.started:
            return JSONResponse({"ready": False, "reason": "starting"}, 503)
        return await readiness_response(self.path.redis)

    async def metrics(self, request: Request) -> Response:
        """Prometheus: the queue per model and lane, the live workers and this process's
        rate-limit refusals by tenant id (no key: scrapers hold none; nothing here names a
        job)."""
        return await metrics_response(self.path.redis, self.settings.lane_partitions,
                                      collectors=[self.path.limiter, self.path.routing],
                                      models=self.path.catalog.names)

    def _stream_url(self, request: Request, job_id: str) -> str:
        base = self._stream_base.get(_base_key(request.scope))
        if base is None:
            base = (self.settings.gateway_url or _ws_base(request)).rstrip("/")
            if len(self._stream_base) < 256:  # Host headers are the client's: bound the cache
                self._stream_base[_base_key(request.scope)] = base
        return f"{base}/v1/jobs/{job_id}/stream"


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
