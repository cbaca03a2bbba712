"""``reference/http.md``: every route ``tidegate up`` serves, from the OpenAPI document it serves.

``served_document`` builds the app ``tidegate up`` runs (the API and the gateway on one port)
and asks it for ``GET /openapi.json``, so the page lists exactly the mounted routes (the
document refuses a route nobody described). Each operation: summary, description, who may call
it, parameters, request body fields and answers; then every schema the operations name.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tidegate.commands.reference.markdown import code, page_head, sentence, table

PAGE = "reference/http.md"
OPENAPI_FILE = "reference/openapi.json"
METHODS = ("get", "post", "put", "patch", "delete")


def served_document() -> dict[str, Any]:
    """The OpenAPI document ``tidegate up`` serves at ``/openapi.json`` (no Redis needed: it is
    built from the routes)."""
    from starlette.testclient import TestClient

    from tidegate.commands.launcher import combined_app
    from tidegate.settings import Settings

    client = TestClient(combined_app(Settings()))  # no lifespan: nothing starts
    answer = client.get("/openapi.json")
    answer.raise_for_status()
    return answer.json()


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in document["paths"].items()
            for method, op in ops.items() if method in METHODS]


def _schema_name(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else None


def _type(schema: dict[str, Any]) -> str:
    if name := _schema_name(schema):
        return f"[{name}](#{name.lower()})"
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    if "enum" in schema:
        return " | ".join(code(json.dumps(v)) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            kinds = [_type(s) for s in schema[key] if s.get("type") != "null"]
            return " or ".join(dict.fromkeys(kinds))
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = " or ".join(k for k in kind if k != "null")
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    return kind


def _fields(schema: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    required = set(schema.get("required", ()))
    rows = []
    for name, prop in schema.get("properties", {}).items():
        default = prop.get("default")
        text = prop.get("description", "")
        if default is not None and default != [] and default != {}:
            text = f"{sentence(text)} Default {code(json.dumps(default))}." if text else \
                f"Default {code(json.dumps(default))}."
        rows.append((code(name), _type(prop), "yes" if name in required else "",
                     sentence(text) if text and not text.startswith("Default") else text))
    return rows


def _security(op: dict[str, Any]) -> str:
    schemes = [name for alternative in op.get("security", []) for name in alternative]
    if not schemes:
        return "No key needed."
    words = {"bearerAuth": "an API key (`Authorization: Bearer <key>`)",
             "streamToken": "the job's stream token (`?token=`)"}
    return "While auth is on, needs " + " or ".join(words.get(s, s) for s in schemes) + "."


def _anchor(method: str, path: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")
    return f"{method}-{slug or 'root'}"


def page(document: dict[str, Any] | None = None) -> str:
    document = document or served_document()
    ops = _operations(document)
    out = page_head("HTTP API", "the OpenAPI document `tidegate up` serves at `/openapi.json`",
                    sentence(document["info"].get("description", "")) + " The whole document: "
                    "[openapi.json](openapi.json). WebSocket routes appear as the `GET` of "
                    "their upgrade request.")
    out.append(table(("method", "path", "summary"),
                     [(f"[{m.upper()}](#{_anchor(m, p)})", code(p), sentence(op["summary"]))
                      for p, m, op in ops]))
    named: list[str] = []
    for path, method, op in ops:
        socket = " (WebSocket)" if op.get("x-websocket") else ""
        out += [f"## {method.upper()} {path}{socket} {{#{_anchor(method, path)}}}", "",
                sentence(op["summary"]), ""]
        if op.get("description"):
            out += [op["description"].strip(), ""]
        out += [_security(op), ""]
        if op.get("parameters"):
            out.append(table(("parameter", "in", "required", "description"), [
                (code(p["name"]), p["in"], "yes" if p.get("required") else "",
                 f"{sentence(p.get('description', ''))} ({_type(p.get('schema', {}))})")
                for p in op["parameters"]]))
        body = op.get("requestBody", {}).get("content", {})
        for media, content in body.items():
            schema = content.get("schema", {})
            name = _schema_name(schema)
            out += [f"Request body ({code(media)}): " + (f"[{name}](#{name.lower()})" if name
                                                       else _type(schema)) + ".", ""]
        answers, inline = [], []
        for status, answer in op.get("responses", {}).items():
            schemas = [c.get("schema", {}) for c in answer.get("content", {}).values()]
            answers.append((code(status), sentence(answer.get("description", "")),
                            ", ".join(dict.fromkeys(_type(s) for s in schemas))))
            inline += [(status, s) for s in schemas if s.get("properties")]
        out.append(table(("status", "meaning", "body"), answers))
        for status, schema in inline:  # an answer described in place: its fields
            out += [f"The `{status}` body:", "",
                    table(("field", "type", "required", "description"), _fields(schema))]
        named += [n for n in _referenced(op) if n not in named]
    out += ["## Schemas", ""]
    schemas = document["components"]["schemas"]
    for name in _closure(named, schemas):
        schema = schemas[name]
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [sentence(schema["description"]), ""]
        rows = _fields(schema)
        out.append(table(("field", "type", "required", "description"), rows) if rows
                   else f"{_type(schema)}\n")
    return "\n".join(out)


def _referenced(node: object) -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        if name := _schema_name(node):
            found.append(name)
        for value in node.values():
            found += _referenced(value)
    elif isinstance(node, list):
        for value in node:
            found += _referenced(value)
    return found


def _closure(names: list[str], schemas: dict[str, Any]) -> list[str]:
    """The named schemas and every schema they refer to, first-seen order."""
    out: list[str] = []
    todo = list(names)
    while todo:
        name = todo.pop(0)
        if name not in out and name in schemas:
            out.append(name)
            todo += _referenced(schemas[name])
    return out


def gaps(document: dict[str, Any] | None = None) -> list[str]:
    document = document or served_document()
    missing = []
    for path, method, op in _operations(document):
        if not op.get("summary", "").strip():
            missing.append(f"route {method.upper()} {path} has no summary")
        for status, answer in op.get("responses", {}).items():
            if not answer.get("description", "").strip():
                missing.append(f"route {method.upper()} {path}: answer {status} has no "
                               "description")
        for parameter in op.get("parameters", []):
            if not parameter.get("description", "").strip():
                missing.append(f"route {method.upper()} {path}: parameter "
                               f"{parameter['name']!r} has no description")
    return missing


def openapi_json(document: dict[str, Any] | None = None) -> str:
    return json.dumps(document or served_document(), indent=2)
