"""``POST /v1/adapters`` (admin) and ``GET /v1/adapters``: LoRA adapters of the served models.

A POST registers the adapter in its model's registry (``tidegate.adapter_registry``), announces
it on ``keys.ADAPTER_CHANNEL`` and waits (up to ``LOAD_WAIT_S``) for the model's live workers to
report: the first that loaded it -> 201 with the workers that had by then; every live worker
failed -> 422 naming ``path`` with the first reason, and the registration is withdrawn; no live
worker -> 202 ``registered`` (workers load every registered adapter when they start).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tidegate import adapter_registry, keys
from tidegate.adapter_registry import AdapterAnnouncement
from tidegate.operations.queue_stats import worker_stats
from tidegate.producer.errors import FieldError
from tidegate.producer.submit.refusal import Refusal, answer, validated
from tidegate.producer.submit.request_body import read_json
from tidegate.producer.submit.submit_path import SubmitPath
from tidegate.protocol import NAME_PATTERN

LOAD_WAIT_S = 30.0
POLL_S = 0.05


class AdapterBody(BaseModel):
    """The body of ``POST /v1/adapters``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="a served model (name or alias)")
    name: str = Field(pattern=NAME_PATTERN, description="the adapter's name")
    path: str = Field(min_length=1, max_length=4096,
                      description="the PEFT adapter directory, as the workers see it")


class AdapterRoutes:
    """The adapter routes over a ``SubmitPath`` (its auth, model catalog and Redis client)."""

    def __init__(self, path: SubmitPath, *, load_wait_s: float = LOAD_WAIT_S):
        self.path = path
        self.load_wait_s = load_wait_s
        self.routes: list[BaseRoute] = [
            Route("/v1/adapters", self.register, methods=["POST"]),
            Route("/v1/adapters", self.list_adapters, methods=["GET"]),
        ]

    async def list_adapters(self, request: Request) -> Response:
        """``GET /v1/adapters``: every served model's registered adapters (any valid key)."""
        return await answer(self._list(request))

    async def register(self, request: Request) -> Response:
        """``POST /v1/adapters``: register an adapter and have the live workers load it."""
        return await answer(self._register(request))

    async def _list(self, request: Request) -> Response:
        self.path.auth.tenant(request.headers.get("authorization"))
        models: list[dict[str, Any]] = []
        for model in self.path.catalog.models:
            found = await adapter_registry.registered(self.path.redis, model.name)
            models.append({"model": model.name, "adapters": [
                {"name": a.name, "path": a.path, "added_ms": a.added_ms}
                for a in found.values()]})
        return JSONResponse({"models": models})

    async def _register(self, request: Request) -> Response:
        self.path.auth.admin(request.headers.get("authorization"))
        body = validated(AdapterBody, await read_json(request))
        model = self.path.catalog.get(body.model)
        if model is None:
            message = (f"the model {body.model!r} does not exist; served: "
                       f"{', '.join(self.path.catalog.names)}")
            raise Refusal(404, "model_not_found", message,
                          [FieldError(field="model", reason=message)])
        redis = self.path.redis
        live = [w.worker_id for w in await worker_stats(redis)
                if (w.model or self.path.catalog.default.name) == model.name]
        earlier = await adapter_registry.register(redis, model.name, body.name, body.path)
        if earlier is not None:
            message = (f"adapter {body.name!r} of {model.name!r} is registered with another "
                       f"path ({earlier.path})")
            raise Refusal(409, "conflict", message, [FieldError(field="name", reason=message)])
        self.path.adapters.forget(model.name)
        reply = {"model": model.name, "name": body.name, "path": body.path}
        if not live:
            return JSONResponse({**reply, "status": "registered"}, 202)
        outcomes = await self._announce_and_wait(model.name, body, live)
        loaded = [w for w, outcome in outcomes.items() if outcome == "ok"]
        if loaded:
            return JSONResponse({**reply, "status": "loaded", "loaded_by": loaded}, 201)
        if len(outcomes) == len(live):  # every live worker failed: nobody can serve it
            await adapter_registry.unregister(redis, model.name, body.name, body.path)
            self.path.adapters.forget(model.name)
            reason = next(iter(outcomes.values())).removeprefix("error: ")
            raise Refusal(422, "invalid_adapter", f"path: {reason}",
                          [FieldError(field="path", reason=reason)])
        return JSONResponse({**reply, "status": "registered",
                             "message": f"no worker loaded it within {self.load_wait_s:.0f} s; "
                                        f"workers load registered adapters when they start"},
                            202)

    async def _announce_and_wait(self, model: str, body: AdapterBody,
                                 live: list[str]) -> dict[str, str]:
        """Publish the load and collect the live workers' reports until one loaded it, all
        answered, or the wait ran out: worker id -> "ok" or "error: ...". """
        redis, key = self.path.redis, keys.adapter_loads(model)
        fields = [keys.adapter_load_field(body.name, w) for w in live]
        await redis.hdel(key, *fields)  # an earlier request's reports are not this one's
        message = AdapterAnnouncement(model=model, name=body.name, path=body.path)
        await redis.publish(keys.ADAPTER_CHANNEL, message.model_dump_json())
        deadline = time.monotonic() + self.load_wait_s
        outcomes: dict[str, str] = {}
        while time.monotonic() < deadline:
            values = await redis.hmget(key, fields)
            outcomes = {w: v for w, v in zip(live, values, strict=True) if v is not None}
            if "ok" in outcomes.values() or len(outcomes) == len(live):
                break
            await asyncio.sleep(POLL_S)
        return outcomes

