"""OpenAI-compatible routes on the producer API: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{model}``.

A request's ``model`` is a served model's name or alias (``tidegate``: the default model), or
``base:ADAPTER`` for one of its LoRA adapters; answers carry the string the caller sent.
``/v1/models`` lists every served model with the count of live workers serving it
(``live_workers``: 0 says jobs for it wait for a worker) and their registered adapters (as
``base:NAME`` entries with a ``parent``, vLLM's convention).

A request is translated into a tidegate ``JobRequest`` (``tidegate.producer.openai_compat.schema``), goes
through the same auth, admission, backpressure and enqueue as ``POST /v1/jobs``
(``SubmitPath.submit_job``), and is answered from the job's events
(``tidegate.producer.openai_compat.answer``), as one JSON body or as server-sent events. Every error is in
OpenAI's shape (``tidegate.producer.openai_compat.errors``).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from tidegate import adapter_registry
from tidegate.http.auth import AuthError
from tidegate.model_files.served_model import ServedModel
from tidegate.operations.queue_stats import worker_stats
from tidegate.producer.openai_compat.answer import Answer
from tidegate.producer.openai_compat.errors import OpenAIError, from_refusal, model_not_found
from tidegate.producer.openai_compat.format import ChatShape, CompletionShape, Shape, TokenSpeller
from tidegate.producer.openai_compat.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from tidegate.producer.submit.backlog import LaneFull
from tidegate.producer.submit.rate_limit import with_headers
from tidegate.producer.submit.refusal import Refusal
from tidegate.producer.submit.request_body import read_json
from tidegate.producer.submit.submit_path import SubmitPath
from tidegate.protocol import Job

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

        self._spellers: dict[str, TokenSpeller] = {}

    def speller(self, model: str) -> TokenSpeller:
        """The token speller of a served model's tokenizer (loaded by SubmitPath.start())."""
        speller = self._spellers.get(model)
        if speller is None:
            speller = TokenSpeller(self.path.admission_for(model).tokenizer)
            self._spellers[model] = speller
        return speller

    async def completions(self, request: Request) -> Response | ASGIApp:
        """``POST /v1/completions``."""
        return await self._generate(request, CompletionRequest, CompletionShape, "cmpl-")

    async def chat_completions(self, request: Request) -> Response | ASGIApp:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, ChatCompletionRequest, ChatShape, "chatcmpl-")

    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: every served model (the default first), each with how many
        live workers serve it and followed by its registered adapters."""
        try:
            self._tenant(request)
            live = await self._live_workers()
            data: list[dict[str, Any]] = []
            for model in self.path.catalog.models:
                data.append(self._model_card(model.name, live=live[model.name]))
                data += [self._model_card(f"{model.name}:{name}", parent=model.name,
                                          live=live[model.name])
                         for name in await self._adapters(model)]
        except OpenAIError as error:
            return error.response()
        except RedisError as exc:
            return _unavailable(exc).response()
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: a served model by any of its names, or one of its
        adapters as ``base:NAME`` (served or not right now), else 404."""
        name = request.path_params["model"]
        try:
            self._tenant(request)
            model = self.path.catalog.get(name)
            if model is not None:
                live = await self._live_workers()
                return JSONResponse(self._model_card(model.name, live=live[model.name]))
            base, _, adapter = name.rpartition(":")
            model = self.path.catalog.get(base)
            if model is None or adapter not in await self._adapters(model):
                raise model_not_found(name, self.path.catalog.names)
            live = await self._live_workers()
        except OpenAIError as error:
            return error.response()
        except RedisError as exc:
            return _unavailable(exc).response()
        return JSONResponse(self._model_card(name, parent=model.name, live=live[model.name]))

    async def _live_workers(self) -> Counter[str]:
        """Live workers per served model name (a heartbeat without a model: the default's)."""
        default = self.path.catalog.default.name
        return Counter(w.model or default for w in await worker_stats(self.path.redis))

    async def _generate(self, request: Request,
                        kind: type[CompletionRequest] | type[ChatCompletionRequest],
                        shape: type[ChatShape] | type[CompletionShape],
                        id_prefix: str) -> Response | ASGIApp:
        rate_headers: dict[str, str] = {}  # x-ratelimit-*, for every answer once charged
        try:
            tenant = self._tenant(request)
            body = parse_body(kind, await self._read_json(request))
            job = await self._submit(body, tenant, rate_headers)
        except OpenAIError as error:
            return error.response()
        tokenizer = self.path.admission_for(job.model).tokenizer
        answer_shape: Shape = shape(
            id=f"{id_prefix}{job.id}", model=body.model, created=int(time.time()),
            logprobs=body.wants_logprobs,
            include_usage=bool(body.stream) and body.include_usage,
            tool_format=(tokenizer.tool_format
                         if isinstance(body, ChatCompletionRequest) and body.offers_tools
                         else None),
            echo=body.echo_text if isinstance(body, CompletionRequest) else "",
            n=body.n or 1)
        return with_headers(
            Answer(self.path.redis, self.path.hub, job.id, answer_shape, self.speller(job.model),
                   stream=bool(body.stream), retry_after_s=self.path.settings.retry_after_s),
            rate_headers)

    async def _submit(self, body: CompletionRequest | ChatCompletionRequest, tenant: str,
                      rate_headers: dict[str, str]) -> Job:
        """Admit and enqueue the request's job as ``POST /v1/jobs`` does (a rate-limit refusal
        included: ``from_refusal`` keeps its headers); the job."""
        job_request = body.job_request().model_copy(update={"model": body.model})
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
            raise _unavailable(exc) from exc
        return job

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

    async def _adapters(self, model: ServedModel) -> list[str]:
        return list(await adapter_registry.registered(self.path.redis, model.name))

    def _model_card(self, model_id: str, *, parent: str | None = None,
                    live: int = 0) -> dict[str, Any]:
        card: dict[str, Any] = {"id": model_id, "object": "model", "created": self.created,
                                "owned_by": OWNED_BY, "live_workers": live}
        if parent is not None:
            card.update(parent=parent, root=parent)
        return card


def _unavailable(exc: RedisError) -> OpenAIError:
    return OpenAIError(503, f"the job store is unavailable ({type(exc).__name__}); retry later",
                       code="service_unavailable")
