"""uvicorn's WebSocket protocol plus one ASGI extension: write a ready-made frame, no await.

A job's event goes to every client watching it as the same bytes: server frames are not
masked, so one frame built once per event serves them all. The standard ASGI path would frame
it again for each client and wake each client's sender task; at thousands of clients that
per-client work is most of a gateway's CPU. The extension ``tidegate.websocket.frames``
(in the connection's ``scope["extensions"]``) offers ``write(frame) -> bool``: the frame goes
straight to the transport, in order with everything else sent on the connection (the event
loop runs one callback at a time, and ASGI sends write whole frames too). It refuses (False)
when the connection is closing or its write buffer is over the high-water mark: the caller then
falls back to the awaited ASGI path, whose back-pressure is what detects a slow client. It also
reports ``backlog_bytes()``, what the connection holds that the client has not taken: the
transport's write buffer plus the kernel's send queue (where a client that stops reading piles
up hundreds of kB before the transport notices), and ``abort()`` drops a connection at once.

Only offered when the connection negotiated no extension (no permessage-deflate), since
a raw frame would bypass compression. ``UVICORN_OPTIONS`` (``tidegate.http.server_options``)
selects this protocol for every server tidegate runs.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import HeaderLineTooLong, RequestLineTooLong, TooManyHeaders

from tidegate.http.http_protocol import error_response

FRAMES_EXTENSION = "tidegate.websocket.frames"
_SIOCOUTQ = 0x5411  # Linux: bytes in a socket's send queue (the same number as TIOCOUTQ)
_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def text_frame(payload: bytes) -> bytes:
    """An unfragmented, unmasked RFC 6455 text frame (FIN set, opcode 1) holding ``payload``."""
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x81, n)
    elif n < 1 << 16:
        header = struct.pack("!BBH", 0x81, 126, n)
    else:
        header = struct.pack("!BBQ", 0x81, 127, n)
    return header + payload


@dataclass(frozen=True, slots=True)
class FrameWriter:
    """What the extension hands the app: ``write(frame)``, True if the frame went out."""

    protocol: TidegateWebSocketProtocol

    def write(self, frame: bytes) -> bool:
        return self.protocol.write_frame(frame)

    def backlog_bytes(self) -> int:
        return self.protocol.backlog_bytes()

    def abort(self) -> None:
        self.protocol.transport.abort()


class TidegateWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, with the frame-writing extension."""

    _socket_fd = -1  # for the kernel's send queue size; -1: not readable here

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sys.platform == "linux" and sock is not None and sock.family in _TCP_FAMILIES:
            self._socket_fd = sock.fileno()

    def backlog_bytes(self) -> int:
        """Bytes written to this connection that the client has not taken yet (still in the
        transport's buffer, or in the kernel's send queue: unsent or unacknowledged)."""
        if self.transport.is_closing():
            return 0  # nothing more goes out: the relay is ending anyway
        held = self.transport.get_write_buffer_size()
        if self._socket_fd >= 0:
            try:
                raw = fcntl.ioctl(self._socket_fd, _SIOCOUTQ, b"\0\0\0\0")
                held += struct.unpack("i", raw)[0]
            except OSError:
                self._socket_fd = -1
        return held

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # websockets refuses a handshake it cannot parse (a line over 8192 bytes, too many
        # headers) into its own output buffer, which uvicorn before 0.55 never flushes: the
        # client would wait for an answer that never comes. Answer it and close.
        exc = self.conn.handshake_exc
        if exc is not None and not self.handshake_initiated and not self.transport.is_closing():
            self.transport.write(_handshake_refusal(exc))
            self.transport.close()

    def handle_handshake_exception(self) -> None:
        # uvicorn 0.55 and later answer such a handshake themselves, with websockets' plain
        # text; answer in the API's JSON shape instead, as on every other refusal.
        exc = self.conn.handshake_exc
        if exc is None or self.transport.is_closing():
            super().handle_handshake_exception()
            return
        self.handshake_complete = True
        self.close_sent = True
        self.conn.data_to_send()  # drop websockets' own answer
        self.transport.write(_handshake_refusal(exc))
        self.transport.close()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        # No scope: the handshake was refused. Extensions negotiated: frames must go through
        # the connection's own encoder.
        if scope is not None and not self.conn.extensions:
            scope["extensions"][FRAMES_EXTENSION] = {"writer": FrameWriter(self)}

    def write_frame(self, frame: bytes) -> bool:
        if (not self.handshake_complete or self.close_sent or self.disconnected
                or not self.writable.is_set() or self.transport.is_closing()):
            return False
        self.transport.write(frame)
        return True


def _handshake_refusal(exc: BaseException) -> bytes:
    if isinstance(exc, RequestLineTooLong):
        return error_response(414, "url", f"the request line is too long ({exc})")
    if isinstance(exc, HeaderLineTooLong | TooManyHeaders):
        return error_response(431, "headers", f"the request headers are too large ({exc})")
    return error_response(400, None, "the WebSocket handshake is not valid HTTP/1.1")


def frame_writer(scope: dict[str, Any]) -> FrameWriter | None:
    """The connection's frame writer, or None where the server does not offer one."""
    ext = scope.get("extensions") or {}
    entry = ext.get(FRAMES_EXTENSION)
    return entry.get("writer") if isinstance(entry, dict) else None
