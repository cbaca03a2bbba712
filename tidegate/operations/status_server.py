"""A role's own HTTP port, for roles that serve no HTTP: ``/metrics``, ``/healthz``, ``/readyz``.

The GPU worker and the batch worker get a small threaded WSGI server beside their event loop: it
answers while a model loads and while a step runs, and the role only ever sets flags on it (or
gives it a readiness check to run). Liveness is "the process answers"; readiness is "the model
is loaded (where there is one), Redis answered, and the role is not draining".
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("tidegate.status")


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        pass  # a scrape every few seconds is not news


class StatusServer:
    def __init__(self, host: str, port: int, *,
                 check: Callable[[], str | None] | None = None) -> None:
        """``check`` (run per /readyz, in the server's thread) returns why the role is not
        ready, or None; without it the flags below decide."""
        self.host, self.port = host, port
        self.registry: CollectorRegistry | None = None
        self.model_loaded = False
        self.redis_ok = False
        self.draining = False
        self.check = check
        self._server: WSGIServer | None = None

    @property
    def ready(self) -> tuple[bool, str]:
        if self.check is not None:
            reason = self.check()
            return (True, "ready") if reason is None else (False, reason)
        if not self.model_loaded:
            return False, "loading the model"
        if self.draining:
            return False, "draining"
        if not self.redis_ok:
            return False, "Redis is unreachable"
        return True, "ready"

    def start(self) -> bool:
        """Listen in a daemon thread; False (with a warning) if the port is taken."""
        try:
            self._server = make_server(self.host, self.port, self._app,
                                       server_class=_ThreadingServer,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            log.warning("status port %s:%d unavailable (%s): no /metrics, /healthz, /readyz",
                        self.host, self.port, exc)
            return False
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="status-server",
                         daemon=True).start()
        log.info("status on http://%s:%d (/metrics, /healthz, /readyz)", self.host, self.port)
        return True

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _app(self, environ: dict, start_response):  # noqa: ANN202 - WSGI
        path = environ.get("PATH_INFO", "")
        if path == "/metrics" and self.registry is not None:
            return make_wsgi_app(self.registry)(environ, start_response)
        if path == "/healthz":
            return self._json(start_response, 200, {"status": "ok"})
        if path == "/readyz":
            ok, reason = self.ready
            return self._json(start_response, 200 if ok else 503,
                              {"ready": ok, "reason": reason})
        return self._json(start_response, 404, {"error": {
            "type": "not_found", "message": f"no route {path}", "fields": []}})

    @staticmethod
    def _json(start_response, status: int, body: dict) -> list[bytes]:  # noqa: ANN001
        data = json.dumps(body).encode()
        phrase = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
        start_response(f"{status} {phrase}", [("Content-Type", "application/json"),
                                              ("Content-Length", str(len(data)))])
        return [data]
