"""The gateway against hostile clients (issue 14): close reasons of non-ASCII text, bad frames
while a job streams, oversized handshakes, and clients that stop reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tests.streaming.test_gateway import (
    done,
    ids,
    publish,
    read_all,
    started,
    stream_url,
    token,
)
from tests.streaming.test_gateway_at_scale import big_token
from tidegate.events.event_log import add_event
from tidegate.jobstore import enqueue
from tidegate.protocol import JobRequest
from tidegate.settings import Settings
from tidegate.streaming.gateway import create_app

pytestmark = pytest.mark.timeout(60)


async def frames_for(ws: ClientConnection, seconds: float) -> tuple[list[str], int | None]:
    """The frames received within ``seconds`` and the close code (None: still open)."""
    frames: list[str] = []
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        async with asyncio.timeout(seconds):
            async for raw in ws:
                frames.append(str(raw))
    return frames, ws.close_code


@pytest.fixture(scope="module")
def gateway_http(redis_server: RedisServer) -> Iterator[str]:
    with serve(create_app(Settings(redis_url=redis_server.url))) as url:
        yield url


@pytest.fixture
def gateway(gateway_http: str, redis_url: str) -> str:
    """The gateway's ws:// base URL, over a freshly flushed Redis."""
    return gateway_http.replace("http://", "ws://")


@pytest.fixture
async def job_id(aredis: aioredis.Redis) -> str:
    job = JobRequest(prompt="hello").to_job(model="random_tiny", default_timeout_s=60)
    await enqueue(aredis, job)
    return job.id


async def test_a_non_ascii_close_reason_is_cut_to_123_bytes_and_still_4400(
        gateway: str, job_id: str) -> None:
    async with ws_connect(stream_url(gateway, job_id)) as ws:
        assert ids([await ws.recv()]) == [1]
        await ws.send(json.dumps({"type": "ü" * 100}))  # named in the reason: 200+ bytes
        frames, code = await read_all(ws)
        reason = ws.close_reason or ""
    assert code == 4400
    error = json.loads(frames[-1])
    assert error["code"] == "bad_frame" and error["message"].startswith(reason)
    assert 100 < len(reason.encode()) <= 123 and "üü" in reason


async def test_a_bad_frame_while_the_job_streams_is_refused_on_every_connection(
        gateway: str, aredis: aioredis.Redis, job_id: str) -> None:
    """The bad frame arrives while the relay replays the stream: its sender is inside a Redis
    command, where one cancel() can be lost (Python 3.11's wait_for in redis-py). Every
    connection must still be refused at once, not after the job's last token."""
    await publish(aredis, job_id, [started(job_id)])
    streaming = asyncio.Event()
    streaming.set()

    async def stream_tokens() -> None:  # a token every ~2 ms until the clients are done
        event_id = 3
        while streaming.is_set() and event_id < 5000:
            await publish(aredis, job_id, [token(job_id, event_id)])
            event_id += 1
            await asyncio.sleep(0.002)

    async def send_bad_frame() -> tuple[list[str], int | None, float]:
        async with ws_connect(stream_url(gateway, job_id)) as ws:
            sent = time.monotonic()
            await ws.send('{"type": "subscribe"}')
            frames, code = await frames_for(ws, 3.0)
            return frames, code, time.monotonic() - sent

    publisher = asyncio.create_task(stream_tokens())
    try:
        results = []
        for _ in range(4):  # 4 rounds of 6 connections at once
            results += await asyncio.gather(*(send_bad_frame() for _ in range(6)))
    finally:
        streaming.clear()
        await publisher
    codes = [code for _, code, _ in results]
    assert codes == [4400] * len(results), codes
    for frames, _, took_s in results:
        assert json.loads(frames[-1])["code"] == "bad_frame"
        assert took_s < 2.0, took_s


# ---------------------------------------------------------------- oversized request heads


def raw_exchange(http: str, request: bytes) -> tuple[float, bytes]:
    """Send a raw request; (seconds to the answer, the answer up to the server's close)."""
    host, port = http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        started_at = time.monotonic()
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):  # the server closes after answering
            answer += chunk
        return time.monotonic() - started_at, answer


def upgrade(target: bytes, extra_headers: bytes = b"") -> bytes:
    return (b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n" + extra_headers + b"\r\n")


def get(target: bytes, extra_headers: bytes = b"") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + extra_headers + b"\r\n"


LONG = b"x" * 10_000
HEADERS = b"".join(b"X-%d: y\r\n" % i for i in range(200))


@pytest.mark.parametrize("http_impl", ["tidegate", "h11"])
@pytest.mark.parametrize(("request_bytes", "status", "field"), [
    (upgrade(b"/v1/jobs/abc/stream?token=" + LONG), 414, "url"),
    (upgrade(b"/v1/jobs/" + LONG + b"/stream"), 414, "url"),
    (upgrade(b"/v1/jobs/abc/stream", b"X-Long: " + LONG + b"\r\n"), 431, "headers"),
    (upgrade(b"/v1/jobs/abc/stream", HEADERS), 431, "headers"),
    (get(b"/healthz?x=" + LONG * 10), 414, "url"),
    (get(b"/healthz", b"X-Long: " + LONG * 100 + b"\r\n"), 431, "headers"),
    (get(b"/healthz", HEADERS), 431, "headers"),
], ids=["ws-long-query", "ws-long-path", "ws-long-header", "ws-many-headers",
        "http-long-query", "http-1mb-header", "http-many-headers"])
def test_an_oversized_request_head_is_answered_at_once_with_a_json_error(
        redis_server: RedisServer, http_impl: str, request_bytes: bytes, status: int,
        field: str) -> None:
    """A 10 kB query on a WebSocket handshake was never answered (websockets gave up on the
    line silently); HTTP took a 1 MB header. Both are refused at once, in the API's shape.
    With h11 (a server not using tidegate's HTTP protocol) the WebSocket side answers too."""
    if http_impl == "h11" and not request_bytes.startswith(b"GET /v1/jobs/"):
        pytest.skip("h11's own limits answer plain HTTP")
    options = {} if http_impl == "tidegate" else {"http": "h11"}
    app = create_app(Settings(redis_url=redis_server.url))
    with serve(app, **options) as http:
        took_s, answer = raw_exchange(http, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["fields"][0]["field"] == field and error["message"]
    assert error["type"] == {414: "url_too_long", 431: "headers_too_large"}[status]
    assert took_s < 2.0


# ---------------------------------------------------------------- clients that stop reading


async def test_a_client_that_stops_reading_is_cut_with_1013_within_seconds(
        redis_server: RedisServer, redis_url: str) -> None:
    """Small token events, as a real job streams them: before, ~800 KB piled up in the kernel's
    buffers unseen, the queue never overflowed and the keepalive cut the client after 40 s
    (1011). The gateway counts what it holds for the client, write buffers included, and cuts
    it with 1013 once that passes ``watcher_backlog_bytes``; a reader on the same job goes on."""
    limit = 64 * 1024
    app = create_app(Settings(redis_url=redis_server.url, watcher_backlog_bytes=limit))
    with serve(app) as http:
        hub = app.state.gateway.hub
        base = http.replace("http://", "ws://")
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        job = JobRequest(prompt="hello").to_job(model="random_tiny", default_timeout_s=60)
        await enqueue(redis, job)
        url = stream_url(base, job.id)
        # max_queue=1: once a frame waits unread, the client library stops reading its socket.
        stalled = await ws_connect(url, max_queue=1, max_size=None).__aenter__()
        reader = await ws_connect(url).__aenter__()
        assert ids([await stalled.recv()]) == ids([await reader.recv()]) == [1]
        await publish(redis, job.id, [started(job.id)])
        assert ids([await stalled.recv(), await reader.recv()]) == [2, 2]
        received = asyncio.create_task(frames_for(reader, 40))
        stalled_at = time.monotonic()
        cut_after_s = None
        event_id, published_bytes = 3, 0
        while time.monotonic() - stalled_at < 20:  # ~150-byte token events, ~150 kB/s
            pipe = redis.pipeline(transaction=False)
            for raw in (token(job.id, i) for i in range(event_id, event_id + 50)):
                add_event(pipe, job.id, raw)
                published_bytes += len(raw)
            await pipe.execute()
            event_id += 50
            await asyncio.sleep(0.05)
            if hub.watchers == 1:  # the stalled client's watcher is gone: it was cut
                cut_after_s = time.monotonic() - stalled_at
                break
        last = event_id - 1
        await publish(redis, job.id, [done(job.id, last + 1)])
        frames, code = await received
        assert (ids(frames), code) == (list(range(3, last + 2)), 1000)
        # Before: not within 20 s (the queue never filled while the kernel buffers did).
        assert cut_after_s is not None and cut_after_s < 8.0, (cut_after_s, published_bytes)
        # The stalled client reads again: what it had been sent, then the 1013 close.
        got, close_code = await frames_for(stalled, 20)
        got_ids = ids(got)
        assert close_code == 1013 and got_ids == list(range(3, 3 + len(got_ids)))
        assert stalled.close_reason == f"lagging; resume after event {got_ids[-1]}"
        await reader.close()
        await redis.aclose()


def server_side_connections(port: int) -> int:
    """Established TCP connections whose local end is ``port`` (the server's side), from
    /proc: the test's client sockets have it as their remote end."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                count += int(local.rsplit(":", 1)[1], 16) == port and state == "01"
    return count


async def test_a_cut_client_that_never_reads_again_is_dropped_after_the_grace(
        redis_server: RedisServer, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut while its write buffer is full (its queue overflowed), the close frame cannot even
    be written: after the grace the connection is aborted. Before, the closing transport
    waited for that buffer to drain, which never happens: the socket stayed open for good."""
    monkeypatch.setattr("tidegate.events.ws_relay.LAGGING_CLOSE_GRACE_S", 1.0)
    # Only the queue cuts here: it overflows once the sender waits for a full write buffer.
    app = create_app(Settings(redis_url=redis_server.url, watcher_queue_size=8,
                              watcher_backlog_bytes=1 << 30))
    with serve(app) as http:
        port = int(http.rsplit(":", 1)[1])
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        job = JobRequest(prompt="hello").to_job(model="random_tiny", default_timeout_s=60)
        await enqueue(redis, job)
        sock = socket.socket()  # a tiny receive buffer: the kernel's buffers fill soon
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        stalled = await ws_connect(stream_url(http.replace("http://", "ws://"), job.id),
                                   sock=sock, max_queue=1, max_size=None,
                                   compression=None).__aenter__()
        assert ids([await stalled.recv()]) == [1]
        hub = app.state.gateway.hub
        await publish(redis, job.id, [started(job.id)])
        event_id = 3
        async with asyncio.timeout(20):
            while hub.watchers:  # 32 kB events until the stalled client's queue overflows
                await publish(redis, job.id, [big_token(job.id, event_id)])
                event_id += 1
                await asyncio.sleep(0.002)
        assert server_side_connections(port) == 1  # the grace: its close may still go out
        async with asyncio.timeout(8):  # 1 s of grace; uvicorn's own close timer is 10 s
            while server_side_connections(port):
                await asyncio.sleep(0.1)
        stalled.transport.abort()
        await redis.aclose()
