"""Serve an ASGI app with uvicorn on a free port in a background thread, for tests over real
HTTP and WebSocket. A thread (its own event loop) serves sync and async tests alike and can
outlive one test's event loop, so a server can be shared by a whole module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp


@contextmanager
def serve(app: ASGIApp, *, startup_timeout_s: float = 10.0,
          **options: object) -> Iterator[str]:
    """Run ``app`` (lifespan included) while the block runs; yields ``http://127.0.0.1:PORT``.
    ``options`` override the servers' own uvicorn options."""
    from tidegate.http.server_options import UVICORN_OPTIONS  # the servers' own options

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=2,
                            **{**UVICORN_OPTIONS, **options})  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start (see the log above)")
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def server_errors(records: list[logging.LogRecord]) -> list[str]:
    """ERROR records logged by the server side (uvicorn, starlette, tidegate) during a test."""
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR]
