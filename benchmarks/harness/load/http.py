"""A minimal HTTP/1.1 keep-alive client: the few requests the load generator makes, cheaply.

httpx spends a few hundred microseconds of Python per request; a request here costs a few tens,
so one generator process can offer thousands of submits per second. Only what tidegate's servers
answer is handled: bodies with a Content-Length, chunked streams (SSE), keep-alive.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

# uvicorn closes keep-alive connections idle for 5 s; never reuse one that may be closing.
MAX_IDLE_S = 2.0
READ_LIMIT = 1 << 22  # bytes StreamReader may buffer for one header block or chunk line


class HttpError(Exception):
    """A response this client cannot read (or none at all)."""


class StaleConnection(HttpError):
    """A reused connection closed before any answer: the server never saw the request."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    sent_at: float  # time.monotonic() when the request was written (after any pool wait)

    def json(self) -> Any:
        return json.loads(self.body)


class Connection:
    """One TCP connection speaking HTTP/1.1, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host
        self.requests = 0
        self.last_used = time.monotonic()

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port, limit=READ_LIMIT)
        return cls(reader, writer, f"{host}:{port}")

    def send(self, method: str, path: str, body: bytes = b"",
             headers: Mapping[str, str] | None = None) -> None:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body or method in ("POST", "PUT"):
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        self.requests += 1

    async def read_head(self) -> tuple[int, dict[str, str]]:
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial and self.requests > 1:
                raise StaleConnection("the server closed the kept-alive connection") from None
            raise HttpError("the connection closed before the response head") from None
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return int(status_line.split(" ", 2)[1]), headers

    async def read_body(self, headers: Mapping[str, str]) -> bytes:
        if "content-length" in headers:
            return await self.reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return b"".join([chunk async for chunk in self.chunks()])
        raise HttpError("a response with neither Content-Length nor chunked encoding")

    async def chunks(self) -> AsyncIterator[bytes]:
        """A chunked body's chunks as they arrive (trailers are not expected)."""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return
            yield (await self.reader.readexactly(size + 2))[:-2]

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> Response:
        sent_at = time.monotonic()
        self.send(method, path, body, headers)
        status, head = await self.read_head()
        payload = await self.read_body(head)
        self.last_used = time.monotonic()
        return Response(status, head, payload, sent_at)

    @property
    def reusable(self) -> bool:
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and time.monotonic() - self.last_used < MAX_IDLE_S)

    def close(self) -> None:
        self.writer.close()


class Pool:
    """At most ``size`` keep-alive connections to one server, shared by concurrent requests."""

    def __init__(self, host: str, port: int, size: int,
                 headers: Mapping[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self.headers = dict(headers or {})
        self._slots = asyncio.Semaphore(size)
        self._idle: deque[Connection] = deque()
        self.opened = 0

    async def request(self, method: str, path: str, body: bytes = b"") -> Response:
        async with self._slots:
            conn = self._take()
            reused = conn is not None
            if conn is None:
                conn = await self._open()
            try:
                response = await conn.request(method, path, body, self.headers)
            except StaleConnection:
                conn.close()
                if not reused:
                    raise
                conn = await self._open()  # safe to resend: the request was never read
                response = await conn.request(method, path, body, self.headers)
            except BaseException:
                conn.close()
                raise
            if response.headers.get("connection", "").lower() == "close":
                conn.close()
            else:
                self._idle.append(conn)
            return response

    def _take(self) -> Connection | None:
        while self._idle:
            conn = self._idle.pop()  # the most recently used first: least likely to be stale
            if conn.reusable:
                return conn
            conn.close()
        return None

    async def _open(self) -> Connection:
        self.opened += 1
        return await Connection.open(self.host, self.port)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


async def sse_events(host: str, port: int, path: str, headers: Mapping[str, str] | None = None
                     ) -> AsyncIterator[str]:
    """The ``data`` of each Server-Sent Event of ``GET path``, until the server ends the stream.

    Raises ``HttpError`` for an answer other than 200."""
    conn = await Connection.open(host, port)
    try:
        conn.send("GET", path, headers={"Accept": "text/event-stream", **(headers or {})})
        status, head = await conn.read_head()
        if status != 200:
            body = await conn.read_body(head)
            raise HttpError(f"SSE answered {status}: {body[:200]!r}")
        buffer = b""
        async for chunk in conn.chunks():
            buffer += chunk
            *blocks, buffer = buffer.split(b"\n\n")
            for block in blocks:
                data = [line[5:].lstrip() for line in block.split(b"\n")
                        if line.startswith(b"data:")]
                if data:
                    yield b"\n".join(data).decode()
    finally:
        conn.close()
