"""``GET /openapi.json``: every app tidegate serves (``api``, ``gateway``, ``up``) documents every
route it mounts, in a valid OpenAPI 3.1 document whose schemas are valid JSON Schema."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import jsonschema
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_31
from starlette.applications import Starlette
from starlette.routing import Mount, Route, WebSocketRoute

from tidegate.commands.launcher import combined_app
from tidegate.http.openapi import OpenAPIDocs, UndocumentedRoute, openapi_route
from tidegate.producer.api import create_app as api_app
from tidegate.producer.submit.admission import Admission
from tidegate.settings import Settings
from tidegate.streaming.gateway import create_app as gateway_app

SETTINGS = Settings(redis_url="redis://127.0.0.1:1/0", model="random:tiny")
APPS: dict[str, Callable[[], Starlette]] = {
    "api": lambda: api_app(SETTINGS, admission=Admission.for_model("random:tiny")),
    "gateway": lambda: gateway_app(SETTINGS),
    "up": lambda: combined_app(SETTINGS),
}


async def served_document(app: Starlette) -> dict:
    # The document needs no Redis: no lifespan, straight over ASGI.
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.get("/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


def routes_of(app: Starlette) -> set[tuple[str, str]]:
    """(path, method) of every route the app answers, read off Starlette's route objects."""
    out: set[tuple[str, str]] = set()
    for route in app.routes:
        if isinstance(route, WebSocketRoute):
            out.add((route.path_format, "get"))
        elif isinstance(route, Route):
            out |= {(route.path_format, m.lower()) for m in route.methods or ()} - {
                (route.path_format, "head")}
        elif isinstance(route, Mount):
            out.add((route.path + "/{path}", "get"))
        else:
            pytest.fail(f"a route of an unknown kind: {route!r}")
    return out


@pytest.mark.parametrize("name", APPS)
async def test_every_mounted_route_is_in_the_served_document(name: str) -> None:
    app = APPS[name]()
    document = await served_document(app)
    documented = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert routes_of(app) == documented


@pytest.mark.parametrize("name", APPS)
async def test_the_document_is_valid_openapi_3_1(name: str) -> None:
    document = await served_document(APPS[name]())
    jsonschema.Draft202012Validator(OPENAPI_31).validate(document)
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            assert op["responses"] and "security" in op, (method, path)
            if path.startswith("/v1/") and path not in ("/v1/jobs/{job_id}/stream",
                                                        "/v1/stream",
                                                        "/v1/jobs/{job_id}/events"):
                assert op["security"] == [{"bearerAuth": []}], (method, path)


async def test_request_bodies_are_the_pydantic_models() -> None:
    document = await served_document(APPS["up"]())
    schemas = document["components"]["schemas"]
    body = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/JobRequest"}
    assert schemas["JobRequest"]["properties"]["max_tokens"]["maximum"] == 32768
    assert {"ChatCompletionRequest", "CompletionRequest", "Message", "ChatMessage",
            "JobResult", "ErrorBody"} <= set(schemas)


async def test_a_route_nobody_documented_fails_the_document() -> None:
    async def nothing(request):  # noqa: ANN001, ANN202
        return None

    docs = OpenAPIDocs()
    app = Starlette(routes=[Route("/v1/secret", nothing), openapi_route(docs, title="t")])
    with pytest.raises(UndocumentedRoute, match="GET /v1/secret"):
        docs.document(app.routes, title="t")
