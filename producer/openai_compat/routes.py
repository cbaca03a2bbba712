"""OpenAI-compatible routes on the producer API: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{model}``.

A request is translated into a tidegate ``JobRequest`` (``producer.openai_compat.schema``), goes
through the same auth, admission, backpressure and enqueue as ``POST /v1/jobs``
(``SubmitPath.submit_job``), and is answered from the job's events
(``producer.openai_compat.answer``), as one JSON body or as server-sent events. Every error is in
OpenAI's shape (``producer.openai_compat.errors``).
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from producer.openai_compat.answer import Answer
from producer.openai_compat.errors import OpenAIError, from_refusal, model_not_found
from producer.openai_compat.format import ChatShape, CompletionShape, Shape, TokenSpeller
from producer.openai_compat.schema import ChatCompletionRequest, CompletionRequest, parse_body
from producer.submit.backlog import LaneFull
from producer.submit.rate_limit import with_headers
from producer.submit.refusal import Refusal
from producer.submit.request_body import read_json
from producer.submit.submit_path import SubmitPath
from tidegate.http.auth import AuthError
from tidegate.model_files.model_source import resolve_model

ALIAS = "tidegate"  # a model name every deployment answers to, whatever it serves
OWNED_BY = "tidegate"


class OpenAIRoutes:
    """The OpenAI routes over a ``SubmitPath``: its Redis client, auth and admission."""

    def __init__(self, path: SubmitPath):
        self.path = path
        self.created = int(time.time())  # what /v1/models reports as the model's creation
        self.routes: list[BaseRoute] = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
        ]

    @cached_property
    def model_name(self) -> str:
        """The served model's name, as /v1/models lists it and answers carry it."""
        return resolve_model(self.path.settings.model).name

    @cached_property
    def model_names(self) -> frozenset[str]:
        """Every name a request's ``model`` may give: the served name, its spec, ``tidegate``."""
        return frozenset({self.model_name, self.path.settings.model, ALIAS})

    @cached_property
    def speller(self) -> TokenSpeller:
        return TokenSpeller(self.path.admission.tokenizer)  # loaded by SubmitPath.start()

    async def completions(self, request: Request) -> Response | ASGIApp:
        """``POST /v1/completions``."""
        return await self._generate(request, CompletionRequest, CompletionShape, "cmpl-")

    async def chat_completions(self, request: Request) -> Response | ASGIApp:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, ChatCompletionRequest, ChatShape, "chatcmpl-")

    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: the one model this deployment serves."""
        try:
            self._tenant(request)
        except OpenAIError as error:
            return error.response()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: the served model by any of its names, else 404."""
        try:
            self._tenant(request)
            self._check_model(request.path_params["model"])
        except OpenAIError as error:
            return error.response()
        return JSONResponse(self._model_card())

    async def _generate(self, request: Request,
                        kind: type[CompletionRequest] | type[ChatCompletionRequest],
                        shape: type[ChatShape] | type[CompletionShape],
                        id_prefix: str) -> Response | ASGIApp:
        rate_headers: dict[str, str] = {}  # x-ratelimit-*, for every answer once charged
        try:
            tenant = self._tenant(request)
            body = parse_body(kind, await self._read_json(request))
            self._check_model(body.model)
            job_id = await self._submit(body, tenant, rate_headers)
        except OpenAIError as error:
            return error.response()
        answer_shape: Shape = shape(
            id=f"{id_prefix}{job_id}", model=self.model_name, created=int(time.time()),
            logprobs=body.wants_logprobs,
            include_usage=bool(body.stream) and body.include_usage,
            tool_format=(self.path.admission.tokenizer.tool_format
                         if isinstance(body, ChatCompletionRequest) and body.offers_tools
                         else None),
            echo=body.echo_text if isinstance(body, CompletionRequest) else "",
            n=body.n or 1)
        return with_headers(
            Answer(self.path.redis, self.path.hub, job_id, answer_shape, self.speller,
                   stream=bool(body.stream), retry_after_s=self.path.settings.retry_after_s),
            rate_headers)

    async def _submit(self, body: CompletionRequest | ChatCompletionRequest, tenant: str,
                      rate_headers: dict[str, str]) -> str:
        """Admit and enqueue the request's job as ``POST /v1/jobs`` does (a rate-limit refusal
        included: ``from_refusal`` keeps its headers); its id."""
        job_request = body.job_request()
        try:
            job = await self.path.submit_job(job_request, tenant=tenant,
                                            rate_headers=rate_headers)
        except Refusal as refusal:
            raise from_refusal(refusal.status, refusal.type, refusal.message, refusal.fields,
                               refusal.headers, body.param_names) from refusal
        except LaneFull as exc:
            raise OpenAIError(429, str(exc), param="lane", code="queue_full",
                              headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except RedisError as exc:
            raise OpenAIError(503, f"the job store is unavailable ({type(exc).__name__}); "
                              "retry later", code="service_unavailable") from exc
        return job.id

    async def _read_json(self, request: Request) -> Any:
        try:
            return await read_json(request)
        except Refusal as refusal:
            raise from_refusal(refusal.status, refusal.type, refusal.message, refusal.fields,
                               refusal.headers) from refusal

    def _tenant(self, request: Request) -> str:
        try:
            return self.path.auth.tenant(request.headers.get("authorization"))
        except AuthError as exc:
            raise OpenAIError(exc.status, str(exc), code=exc.type, headers=exc.headers) from exc

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise model_not_found(model, self.model_name)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": OWNED_BY}
