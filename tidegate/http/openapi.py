"""The OpenAPI 3.1 document an app serves at ``GET /openapi.json``, built from its mounted routes.

Each role describes its own routes (``OpenAPIDocs.add``: one operation per path and method,
request and response bodies from its pydantic models where it has them); ``openapi_route``
serves the document of whatever app it is mounted in, walking that app's routes, so ``tidegate
api``, ``tidegate gateway`` and ``tidegate up`` each document exactly what they serve. A route
that no role described is an error at the first request, not a silent gap (the fuzz tests
fetch the document and drive every operation in it).

WebSocket routes have no place in OpenAPI; each is documented as a ``GET`` (the upgrade
request) marked ``x-websocket: true``, with its frames in the description.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

OPENAPI_VERSION = "3.1.0"
SCHEMA_REF = "#/components/schemas/{model}"
BEARER = "bearerAuth"  # Authorization: Bearer <API key>
STREAM_TOKEN = "streamToken"  # ?token=<the job's stream token>

Operation = dict[str, Any]


class UndocumentedRoute(RuntimeError):
    """A mounted route (path, method) that no ``OpenAPIDocs`` describes."""


class OpenAPIDocs:
    """Operations by (path, method) and the component schemas they refer to."""

    def __init__(self) -> None:
        self.operations: dict[tuple[str, str], Operation] = {}
        self.schemas: dict[str, Any] = {"ErrorBody": ERROR_BODY}

    def add(self, path: str, method: str, operation: Operation) -> None:
        self.operations[(path, method.lower())] = operation

    def model(self, model: type[BaseModel], *, mode: str = "validation") -> dict[str, str]:
        """A ``$ref`` to ``model``'s JSON schema, registered with the models it refers to."""
        schema = model.model_json_schema(ref_template=SCHEMA_REF, mode=mode)  # type: ignore[arg-type]
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[model.__name__] = schema
        return {"$ref": SCHEMA_REF.format(model=model.__name__)}

    def merged(self, *others: OpenAPIDocs) -> OpenAPIDocs:
        out = OpenAPIDocs()
        for docs in (self, *others):
            out.operations.update(docs.operations)
            out.schemas.update(docs.schemas)
        return out

    def document(self, routes: Sequence[BaseRoute], *, title: str) -> dict[str, Any]:
        """The document of these routes; ``UndocumentedRoute`` for one this lacks."""
        paths: dict[str, dict[str, Operation]] = {}
        for path, method in mounted(routes):
            operation = self.operations.get((path, method))
            if operation is None:
                raise UndocumentedRoute(f"{method.upper()} {path} has no OpenAPI operation")
            paths.setdefault(path, {})[method] = operation
        return {
            "openapi": OPENAPI_VERSION,
            "info": {"title": title, "version": "1",
                     "description": "Errors share one JSON shape (ErrorBody) on tidegate's "
                                    "routes and OpenAI's on the OpenAI-compatible ones."},
            "paths": paths,
            "components": {"schemas": dict(sorted(self.schemas.items())),
                           "securitySchemes": SECURITY_SCHEMES},
        }


def mounted(routes: Sequence[BaseRoute]) -> list[tuple[str, str]]:
    """Every (OpenAPI path, lower-case method) the routes answer; HEAD is implied by GET."""
    found: list[tuple[str, str]] = []
    for route in routes:
        if isinstance(route, Route):
            methods = sorted((route.methods or {"GET"}) - {"HEAD"})
            found += [(route.path_format, m.lower()) for m in methods]
        elif isinstance(route, WebSocketRoute):
            found.append((route.path_format, "get"))
        elif isinstance(route, Mount):  # static files: one operation for every file below
            found.append((route.path.rstrip("/") + "/{path}", "get"))
    return found


def openapi_route(docs: OpenAPIDocs, *, title: str) -> Route:
    """``GET /openapi.json``: the document of the app this route is mounted in."""
    docs.add("/openapi.json", "get", {
        "summary": "This OpenAPI document", "operationId": "openapi", "security": [],
        "responses": {"200": {"description": "The OpenAPI 3.1 document",
                              "content": {"application/json": {"schema": {"type": "object"}}}}},
    })
    built: dict[int, bytes] = {}  # by app: the routes are fixed once the app serves

    async def endpoint(request: Request) -> Response:
        app = request.app
        if id(app) not in built:
            built[id(app)] = JSONResponse(docs.document(app.routes, title=title)).body
        return Response(built[id(app)], media_type="application/json")

    return Route("/openapi.json", endpoint, methods=["GET"])


# ---------------------------------------------------------------- shared pieces

ERROR_BODY: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["type", "message", "fields"],
        "properties": {
            "type": {"type": "string"}, "message": {"type": "string"},
            "fields": {"type": "array", "items": {
                "type": "object", "required": ["field", "reason"],
                "properties": {"field": {"type": "string"}, "reason": {"type": "string"}}}},
        }}},
}
SECURITY_SCHEMES: dict[str, Any] = {
    BEARER: {"type": "http", "scheme": "bearer",
             "description": "An API key (TIDEGATE_API_KEYS); not required when auth is off"},
    STREAM_TOKEN: {"type": "apiKey", "in": "query", "name": "token",
                   "description": "The job's stream token, from its submit answer"},
}
KEY_ONLY: list[dict[str, list[str]]] = [{BEARER: []}]
KEY_OR_TOKEN: list[dict[str, list[str]]] = [{BEARER: []}, {STREAM_TOKEN: []}]


# The per-tenant rate-limit headers (``tidegate.producer.submit.rate_limit``), on submits when limits are set.
_RATE_HEADER_NAMES = {
    "x-ratelimit-limit-requests": ("integer", "requests the key may make per second (burst)"),
    "x-ratelimit-remaining-requests": ("integer", "requests left in the bucket now"),
    "x-ratelimit-reset-requests": ("string", "until the requests bucket is full again (1s)"),
    "x-ratelimit-limit-tokens": ("integer", "tokens (prompt + max_tokens) per minute"),
    "x-ratelimit-remaining-tokens": ("integer", "tokens left in the bucket now"),
    "x-ratelimit-reset-tokens": ("string", "until the tokens bucket is full again (6m0s)"),
}
RATE_HEADERS: dict[str, Any] = {
    name: {"description": what, "schema": {"type": kind}}
    for name, (kind, what) in _RATE_HEADER_NAMES.items()}
RETRY_AFTER: dict[str, Any] = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def error_responses(*statuses: int, schema: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Response objects for error statuses, each the error shape (``ErrorBody`` by default);
    a 429 (a full lane, ``rate_limited``) carries ``Retry-After`` and the rate-limit headers."""
    body = dict(schema) if schema is not None else {"$ref": SCHEMA_REF.format(model="ErrorBody")}
    answers: dict[str, Any] = {}
    for status in statuses:
        answers[str(status)] = {"description": _REASONS.get(status, "Error"),
                                "content": {"application/json": {"schema": body}}}
        if status == 429:
            answers[str(status)]["headers"] = {**RETRY_AFTER, **RATE_HEADERS}
    return answers


def json_response(description: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": dict(schema)}}}


def operator_operations(docs: OpenAPIDocs) -> None:
    """``/healthz``, ``/readyz``, ``/metrics`` (``tidegate.operations.operator_routes``): no key."""
    ready = {"type": "object", "properties": {"ready": {"type": "boolean"},
                                              "reason": {"type": "string"}}}
    docs.add("/healthz", "get", {
        "summary": "Liveness", "operationId": "healthz", "security": [],
        "responses": {"200": json_response("The process answers", {
            "type": "object", "properties": {"status": {"const": "ok"}}})}})
    docs.add("/readyz", "get", {
        "summary": "Readiness: started, and Redis answers", "operationId": "readyz",
        "security": [], "responses": {"200": json_response("Ready", ready),
                                      "503": json_response("Not ready, and why", ready)}})
    docs.add("/metrics", "get", {
        "summary": "Prometheus metrics: the queue per lane, live workers", "operationId": "metrics",
        "security": [], "responses": {"200": {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}})


_REASONS = {400: "Malformed request", 401: "Missing or unknown API key",
            403: "Not this caller's job", 404: "Not found", 409: "Conflict",
            413: "Request body too large", 422: "Invalid request (the fields say why)",
            429: "The lane is full (queue_full) or the key's rate limit is spent "
                 "(rate_limited); retry after Retry-After",
            503: "Redis is unavailable"}
