"""How tidegate runs its ASGI servers: the uvicorn options every server role shares
(``UVICORN_OPTIONS``) and ``serve_asgi``, which runs one app with them.

The CLI (``tidegate api``, ``tidegate gateway``) and the launcher (``tidegate up``) both take
these from here, so neither imports the other for them.
"""

from __future__ import annotations

from starlette.types import ASGIApp

from tidegate.settings import Settings

# Per-message deflate is off: token frames are ~200 bytes, and compressing each one for each
# of thousands of watchers would cost the fan-out most of its CPU.
UVICORN_OPTIONS: dict[str, object] = {
    # The sans-I/O websockets protocol plus tidegate's frame-writing extension (ws_protocol).
    "ws": "tidegate.http.ws_protocol:TidegateWebSocketProtocol",
    # httptools with bounds on the request head, refused as JSON 414/431 (http_protocol).
    "http": "tidegate.http.http_protocol:TidegateHttpProtocol",
    "ws_per_message_deflate": False, "backlog": 4096,
}


def serve_asgi(app: ASGIApp, settings: Settings, *, access_log: bool = True) -> int:
    """Serve ``app`` on ``settings.host:settings.port`` until a signal stops it; 0."""
    import uvicorn

    uvicorn.run(app, host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=access_log,
                **UVICORN_OPTIONS)  # type: ignore[arg-type]
    return 0
