"""uvicorn's httptools HTTP protocol with bounds on the request head, refused in the API's
JSON error shape.

httptools bounds neither the request target nor the header fields (a 1 MB header was served),
and websockets, which parses a WebSocket upgrade again, gives up on a line over 8192 bytes
without a word: the handshake hung until the client gave up. Here a request target over
``MAX_TARGET_BYTES`` gets ``414``, a header field over ``MAX_HEADER_FIELD_BYTES``, more than
``MAX_HEADER_FIELDS`` of them or over ``MAX_HEADER_BYTES`` in all get ``431``, HTTP and WebSocket
alike, before any route runs; any other unparsable request gets ``400`` (uvicorn's answer is
plain text). The bounds sit below websockets' own, so an upgrade that passes them parses there
too. ``UVICORN_OPTIONS`` (``tidegate.http.server_options``) selects this protocol for every
server tidegate runs.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_TARGET_BYTES = 8000  # path and query; websockets refuses a request line over 8192
MAX_HEADER_FIELD_BYTES = 8000  # one field, name and value; websockets: 8192 a line
MAX_HEADER_FIELDS = 100  # websockets: 128
MAX_HEADER_BYTES = 32 * 1024  # every field together
ERROR_TYPES = {400: "invalid_request", 414: "url_too_long", 431: "headers_too_large"}


class HeadTooLarge(Exception):
    """A request head past a bound: the status to answer and what was too large."""

    def __init__(self, status: int, field: str, reason: str):
        super().__init__(reason)
        self.status, self.field, self.reason = status, field, reason


def error_response(status: int, field: str | None, reason: str) -> bytes:
    """A complete HTTP/1.1 response with the API's error body, closing the connection."""
    fields = [{"field": field, "reason": reason}] if field is not None else []
    body = json.dumps({"error": {"type": ERROR_TYPES[status], "message": reason,
                                 "fields": fields}}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class TidegateHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing oversized request heads with a JSON 414/431."""

    _too_large: HeadTooLarge | None = None
    _header_fields = 0
    _header_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._too_large, self._header_fields, self._header_bytes = None, 0, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > MAX_TARGET_BYTES:
            self._refuse(HeadTooLarge(414, "url", "the request target (path and query) is "
                                      f"longer than {MAX_TARGET_BYTES} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        self._header_fields += 1
        self._header_bytes += size
        if size > MAX_HEADER_FIELD_BYTES:
            self._refuse(HeadTooLarge(431, "headers", f"a header field is longer than "
                                      f"{MAX_HEADER_FIELD_BYTES} bytes"))
        if self._header_fields > MAX_HEADER_FIELDS:
            self._refuse(HeadTooLarge(431, "headers",
                                      f"more than {MAX_HEADER_FIELDS} header fields"))
        if self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(HeadTooLarge(431, "headers",
                                      f"header fields longer than {MAX_HEADER_BYTES} bytes"))
        super().on_header(name, value)

    def _refuse(self, too_large: HeadTooLarge) -> None:
        # Raised inside a parser callback: httptools stops and uvicorn answers 400 through
        # send_400_response, which sends this instead.
        self._too_large = too_large
        raise too_large

    def send_400_response(self, msg: str) -> None:
        refusal = self._too_large
        if refusal is None:
            response = error_response(400, None, "the request is not valid HTTP/1.1")
        else:
            response = error_response(refusal.status, refusal.field, refusal.reason)
        self.transport.write(response)
        self.transport.close()
