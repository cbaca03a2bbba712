"""The gateway's routes in OpenAPI (``tidegate.http.openapi``): the job's WebSocket and Server-Sent
Events streams, the queue view, the web page and its static files, the operator routes."""

from __future__ import annotations

from tidegate.events.ws_relay import MAX_RESUME_ID
from tidegate.http.openapi import (
    KEY_ONLY,
    KEY_OR_TOKEN,
    OpenAPIDocs,
    error_responses,
    json_response,
    operator_operations,
)

JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"},
          "description": "the job's id, from its submit answer"}
LAST_EVENT_ID = {"name": "last_event_id", "in": "query", "required": False,
                 "description": "resume after this event id (0: from the start)",
                 "schema": {"type": "integer", "minimum": 0, "maximum": MAX_RESUME_ID}}
TOKEN = {"name": "token", "in": "query", "required": False,
         "description": "the job's stream token (instead of an API key)",
         "schema": {"type": "string"}}
WATCH_DOC = """The job's events after `last_event_id`, then live ones, as JSON text frames
`{"id", "type", ...}`; the client may send `{"type": "ping", "data"?}` (answered with a pong),
anything else is refused with close 4400. Close codes: 1000 done, 1001 going away, 1013 lagging
or the store is unavailable (resume with last_event_id), 4400, 4401, 4403, 4404."""


def gateway_docs() -> OpenAPIDocs:
    """Every route ``Gateway`` mounts."""
    docs = OpenAPIDocs()
    operator_operations(docs)
    docs.add("/v1/jobs/{job_id}/stream", "get", {
        "summary": "WebSocket: a job's events", "operationId": "watchJob",
        "description": WATCH_DOC, "x-websocket": True, "security": KEY_OR_TOKEN,
        "parameters": [JOB_ID, LAST_EVENT_ID, TOKEN],
        "responses": {"101": {"description": "Switching to the WebSocket protocol"}}})
    docs.add("/v1/jobs/{job_id}/events", "get", {
        "summary": "Server-Sent Events: a job's events", "operationId": "jobEvents",
        "security": KEY_OR_TOKEN,
        "parameters": [JOB_ID, LAST_EVENT_ID, TOKEN,
                       {"name": "Last-Event-ID", "in": "header", "required": False,
                        "description": "what EventSource sends when it reconnects",
                        "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}}],
        "responses": {"200": {"description": "`id: N` / `data: <event JSON>` per event",
                              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                      **error_responses(400, 401, 403, 404, 503)}})
    docs.add("/v1/queue", "get", {
        "summary": "The queue per lane and the live workers", "operationId": "queueStats",
        "security": KEY_ONLY,
        "responses": {"200": json_response("A queue snapshot", {"type": "object"}),
                      **error_responses(401, 503)}})
    docs.add("/", "get", {
        "summary": "The live web page", "operationId": "page", "security": [],
        "responses": {"200": {"description": "HTML",
                              "content": {"text/html": {"schema": {"type": "string"}}}}}})
    docs.add("/static/{path}", "get", {
        "summary": "The web page's scripts and styles", "operationId": "static", "security": [],
        "parameters": [{"name": "path", "in": "path", "required": True,
                        "schema": {"type": "string"},
                        "description": "the file, under the page's static folder"}],
        "responses": {"200": {"description": "The file"}, "404": {"description": "No such file"}}})
    return docs
