"""The producer API's routes in OpenAPI (``tidegate.http.openapi``): ``/v1/jobs``, the OpenAI routes,
``/v1/adapters``, ``/v1/stream`` and the operator routes, with request bodies from
``JobRequest``, ``AdapterBody`` and the OpenAI request models."""

from __future__ import annotations

from typing import Any

from tidegate.http.openapi import (
    KEY_ONLY,
    KEY_OR_TOKEN,
    RATE_HEADERS,
    OpenAPIDocs,
    error_responses,
    json_response,
    operator_operations,
)
from tidegate.producer.adapter_routes import AdapterBody
from tidegate.producer.openai_compat.schema import ChatCompletionRequest, CompletionRequest
from tidegate.protocol import JobRequest, JobResult

JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"},
          "description": "the job's id, from its submit answer"}
ACCEPTED = {
    "type": "object", "required": ["id", "stream_url", "status", "stream_token"],
    "properties": {"id": {"type": "string"}, "status": {"type": "string"},
                   "stream_url": {"type": "string", "description": "WebSocket URL of its events"},
                   "stream_token": {"type": "string",
                                    "description": "lets any client watch this job (?token=)"}},
}
OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"],
              "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                             "created": {"type": "integer"}, "owned_by": {"type": "string"},
                             "parent": {"type": "string",
                                        "description": "an adapter's base model"},
                             "root": {"type": "string"},
                             "live_workers": {
                                 "type": "integer", "minimum": 0,
                                 "description": "live workers serving the model now (0: its "
                                                "jobs wait for one)"}}}
ADAPTER = {"type": "object", "required": ["model", "name", "path", "status"],
           "properties": {"model": {"type": "string"}, "name": {"type": "string"},
                          "path": {"type": "string"},
                          "status": {"enum": ["loaded", "registered"]},
                          "loaded_by": {"type": "array", "items": {"type": "string"},
                                        "description": "the workers that loaded it"},
                          "message": {"type": "string"}}}
ADAPTER_LIST = {"type": "object", "required": ["models"], "properties": {"models": {
    "type": "array", "items": {"type": "object", "properties": {
        "model": {"type": "string"},
        "adapters": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "path": {"type": "string"},
            "added_ms": {"type": "integer"}}}}}}}}}
ADAPTER_DOC = """Register a LoRA adapter (a PEFT directory as the workers see it) on a served
model and have its live workers load it. Needs an admin key (TIDEGATE_ADMIN_KEYS, or `admin`
on the key's line of the keys file; open while auth is off). 201: a worker loaded it
(`loaded_by`); 202: registered, no live worker (yet) confirmed it (workers load every
registered adapter when they start); 422 (field `path`): every live worker failed to load it;
409: the name is registered with another path."""
STREAM_DOC = """Submit a job and watch it on one socket. First frame (JSON text):
`{"type": "generate", "request": <a POST /v1/jobs body>, "api_key"?}` or
`{"type": "resume", "job_id", "last_event_id"?, "api_key"? | "token"?}`. The server answers
`{"type": "accepted", "id", "status", "stream_token"}`, then the job's events; a refused request
gets `{"type": "error", "status", "error"}` and close 4400 (invalid), 4401, 4403, 4404, 4409,
4429 or 1013. Later client frames: `{"type": "ping", "data"?}` only."""


def producer_docs() -> OpenAPIDocs:
    """Every route ``ProducerAPI`` mounts (its own, the OpenAI ones, ``/v1/stream``)."""
    docs = OpenAPIDocs()
    operator_operations(docs)
    _job_routes(docs)
    _openai_routes(docs)
    _adapter_routes(docs)
    docs.add("/v1/stream", "get", {
        "summary": "WebSocket: submit a job and stream its events", "operationId": "submitStream",
        "description": STREAM_DOC, "x-websocket": True, "security": KEY_OR_TOKEN,
        "responses": {"101": {"description": "Switching to the WebSocket protocol"}}})
    return docs


def _job_routes(docs: OpenAPIDocs) -> None:
    docs.add("/v1/jobs", "post", {
        "summary": "Submit a job", "operationId": "submitJob", "security": KEY_ONLY,
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                        "schema": {"type": "string", "pattern": r"^[\x21-\x7e]{1,255}$"},
                        "description": "a repeated submit with the same key returns the same "
                                       "job (or the body's idempotency_key)"}],
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": docs.model(JobRequest)}}},
        "responses": {"202": {**json_response("Queued", ACCEPTED), "headers": RATE_HEADERS},
                      "200": json_response("The job an earlier submit with this "
                                           "Idempotency-Key made", ACCEPTED),
                      **error_responses(400, 401, 404, 409, 413, 422, 429, 503)}})
    docs.add("/v1/jobs/{job_id}", "get", {
        "summary": "A job's status and, once finished, its result", "operationId": "getJob",
        "security": KEY_ONLY, "parameters": [JOB_ID],
        "responses": {"200": json_response("The job", docs.model(JobResult, mode="serialization")),
                      **error_responses(401, 403, 404, 503)}})
    docs.add("/v1/jobs/{job_id}/cancel", "post", {
        "summary": "Cancel a job", "operationId": "cancelJob", "security": KEY_ONLY,
        "parameters": [JOB_ID],
        "responses": {"202": json_response("Cancelled (it was queued) or cancelling", {
            "type": "object", "properties": {"id": {"type": "string"},
                                             "status": {"enum": ["cancelled", "cancelling"]}}}),
                      **error_responses(401, 403, 404, 409, 503)}})


def _openai_routes(docs: OpenAPIDocs) -> None:
    errors = error_responses(400, 401, 404, 413, 429, 500, 503, 504, schema=OPENAI_ERROR)
    for path, model, op_id in (("/v1/completions", CompletionRequest, "createCompletion"),
                               ("/v1/chat/completions", ChatCompletionRequest,
                                "createChatCompletion")):
        docs.add(path, "post", {
            "summary": f"OpenAI-compatible {path.removeprefix('/v1/').replace('/', ' ')}",
            "operationId": op_id,
            "security": KEY_ONLY,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": docs.model(model)}}},
            "responses": {"200": _completion_answer(), **errors}})
    docs.add("/v1/models", "get", {
        "summary": "The served models, each with its live workers, and their adapters",
        "operationId": "listModels", "security": KEY_ONLY,
        "responses": {"200": json_response("Models, each followed by its adapters", {
            "type": "object", "properties": {"object": {"const": "list"},
                                             "data": {"type": "array", "items": MODEL_CARD}}}),
                      **error_responses(401, 503, schema=OPENAI_ERROR)}})
    docs.add("/v1/models/{model}", "get", {
        "summary": "A served model by any of its names, or an adapter as base:NAME",
        "operationId": "getModel",
        "security": KEY_ONLY,
        "parameters": [{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"},
                        "description": "a served model's name or alias, or base:ADAPTER"}],
        "responses": {"200": json_response("The model", MODEL_CARD),
                      **error_responses(401, 404, 503, schema=OPENAI_ERROR)}})


def _adapter_routes(docs: OpenAPIDocs) -> None:
    docs.add("/v1/adapters", "post", {
        "summary": "Register a LoRA adapter (admin)", "operationId": "registerAdapter",
        "description": ADAPTER_DOC, "security": KEY_ONLY,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": docs.model(AdapterBody)}}},
        "responses": {"201": json_response("Loaded by a worker", ADAPTER),
                      "202": json_response("Registered", ADAPTER),
                      **error_responses(400, 401, 403, 404, 409, 413, 422, 503)}})
    docs.add("/v1/adapters", "get", {
        "summary": "The registered adapters of every served model",
        "operationId": "listAdapters", "security": KEY_ONLY,
        "responses": {"200": json_response("Adapters per model", ADAPTER_LIST),
                      **error_responses(401, 503)}})


def _completion_answer() -> dict[str, Any]:
    return {"description": "The answer: one JSON body, or server-sent events with `stream`",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}}}
