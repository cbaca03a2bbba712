"""A submitted HTTP body: read under a size bound and parsed as untrusted JSON
(``read_json``), and the ``Idempotency-Key`` header folded into it (``with_header_key``).

The native routes and the OpenAI routes read bodies the same way; only the error shape of
their answers differs (the OpenAI routes translate the ``Refusal`` raised here).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from tidegate import untrusted_json
from tidegate.producer.errors import FieldError
from tidegate.producer.submit.refusal import Refusal

# Far above any admissible prompt (1M characters, escaped); refused before it is buffered.
MAX_BODY_BYTES = 16 * 1024 * 1024


async def read_json(request: Request) -> Any:
    """The request's body parsed as JSON; ``Refusal`` 413 (too large), 400 (not JSON, or the
    client left mid-body)."""
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


def with_header_key(body: Any, header: str | None) -> Any:
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


def _too_large() -> Refusal:
    return Refusal(413, "request_too_large", f"the request body exceeds {MAX_BODY_BYTES} bytes")
