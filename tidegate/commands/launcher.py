"""`tidegate up`: the whole stack on one machine.

Redis comes from the given URL, else a ``redis-server`` started on a free port, else an embedded
fakeredis server (with a warning). One worker process runs as a child, serving every model
(``--model`` repeated, ``--models-file``; one engine each) with their ``--lora`` adapters; the HTTP API and the
WebSocket gateway share one port in this process. This module is the composition root, so it is
the one place in ``tidegate/`` that imports the roles (lazily, inside functions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import redis

from tidegate import keys
from tidegate.cancelling import cancel_and_wait
from tidegate.model_files.served_model import served_models
from tidegate.redis_conn import connect, connect_sync, redacted
from tidegate.settings import Settings

log = logging.getLogger("tidegate.up")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_redis(url: str, timeout_s: float = 10.0) -> None:
    client = connect_sync(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def local_redis(url: str | None) -> Iterator[str]:
    """Yield a Redis URL: the given one, a private redis-server, or embedded fakeredis."""
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe:
        with tempfile.TemporaryDirectory(prefix="tidegate-redis-") as workdir:
            port = free_port()
            proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                 "--save", "", "--appendonly", "yes", "--protected-mode", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            try:
                url = f"redis://127.0.0.1:{port}/0"
                _wait_for_redis(url)
                log.info("started redis-server on port %d", port)
                yield url
            finally:
                proc.terminate()
                proc.wait(10)
        return
    from fakeredis import TcpFakeServer

    log.warning("redis-server is not installed: using an embedded fakeredis server "
                "(in memory, single process; install redis-server for anything real)")
    server = TcpFakeServer(("127.0.0.1", free_port()), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="fakeredis")
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"redis://{host}:{port}/0"
    finally:
        server.shutdown()
        server.server_close()


def combined_app(settings: Settings):  # -> Starlette
    """The HTTP API and the WebSocket gateway as one ASGI app on one port."""
    from starlette.applications import Starlette

    from tidegate.http.auth import Auth
    from tidegate.http.openapi import openapi_route
    from tidegate.producer.api import ProducerAPI
    from tidegate.producer.openapi_paths import producer_docs
    from tidegate.streaming.gateway import Gateway
    from tidegate.streaming.openapi_paths import gateway_docs

    auth = Auth.from_settings(settings)  # one, so "auth is off" is said once
    api = ProducerAPI(settings, auth=auth)
    # One /metrics (the gateway's) carries the API's counters too: refusals, routes.
    gateway = Gateway(settings, auth=auth, collectors=[api.path.limiter, api.path.routing])

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        await api.start()
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()
            await api.stop()

    # One process: the API's probes (its readiness covers admission), the gateway's /metrics
    # (the queue plus its watchers).
    api_routes = [r for r in api.routes if getattr(r, "path", "") != "/metrics"]
    gateway_routes = [r for r in gateway.routes
                      if getattr(r, "path", "") not in ("/healthz", "/readyz")]
    docs = producer_docs().merged(gateway_docs())
    routes = [*api_routes, *gateway_routes, openapi_route(docs, title="tidegate")]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers=dict(api.exception_handlers))


def _model_env(settings: Settings) -> dict[str, str]:
    """The served models as the child processes read them: the API's list, exactly."""
    env = {"TIDEGATE_MODEL": settings.model, "TIDEGATE_MODELS": json.dumps(settings.models),
           "TIDEGATE_LORAS": json.dumps(settings.loras)}
    if settings.models_file:
        env["TIDEGATE_MODELS_FILE"] = settings.models_file
    return env


def _spawn_worker(settings: Settings) -> subprocess.Popen:
    env = dict(os.environ)
    # The URL goes through the environment, not argv: it may hold a password.
    env["TIDEGATE_REDIS_URL"] = settings.redis_url
    env.update(_model_env(settings))
    env["TIDEGATE_MAX_LORAS"] = str(settings.max_loras)
    env["TIDEGATE_MAX_LORA_RANK"] = str(settings.max_lora_rank)
    env["TIDEGATE_DEVICE"] = settings.device
    env["TIDEGATE_DTYPE"] = settings.dtype
    env["TIDEGATE_WEIGHTS"] = settings.weights
    env["TIDEGATE_CPU_ACTIVATIONS"] = settings.cpu_activations
    for name in ("max_num_seqs", "max_num_batched_tokens"):  # unset: the device's default
        if getattr(settings, name) is not None:
            env[f"TIDEGATE_{name.upper()}"] = str(getattr(settings, name))
    if settings.kv_cache_gb is not None:
        env["TIDEGATE_KV_CACHE_GB"] = str(settings.kv_cache_gb)
    env["TIDEGATE_KV_CACHE_DTYPE"] = settings.kv_cache_dtype
    env["TIDEGATE_QUANTIZE"] = settings.quantize
    env["TIDEGATE_TENSOR_PARALLEL_SIZE"] = str(settings.tensor_parallel_size)
    env["TIDEGATE_PIPELINE_PARALLEL_SIZE"] = str(settings.pipeline_parallel_size)
    env["TIDEGATE_SPECULATIVE"] = settings.speculative
    env["TIDEGATE_NUM_SPECULATIVE_TOKENS"] = str(settings.num_speculative_tokens)
    if settings.speculative_max_batch is not None:
        env["TIDEGATE_SPECULATIVE_MAX_BATCH"] = str(settings.speculative_max_batch)
    env["TIDEGATE_PREFIX_ROUTING"] = str(settings.prefix_routing).lower()
    env["TIDEGATE_STEAL_DELAY_MS"] = str(settings.steal_delay_ms)
    return subprocess.Popen([sys.executable, "-m", "tidegate", "worker"], env=env)


def _spawn_batch_worker(settings: Settings) -> subprocess.Popen | None:
    """The arq batch worker, where Redis can run it (arq needs INFO, which fakeredis lacks)."""
    client = connect_sync(settings.redis_url)
    try:
        client.info("server")
    except redis.exceptions.RedisError:
        log.warning("this Redis has no INFO (embedded fakeredis): batches (tidegate batch) "
                    "need a real redis-server; no batch worker started")
        return None
    finally:
        client.close()
    env = dict(os.environ)
    env["TIDEGATE_REDIS_URL"] = settings.redis_url
    env.update(_model_env(settings))  # a batch line's model resolves as the API's would
    return subprocess.Popen([sys.executable, "-m", "tidegate", "batch-worker",
                             "--log-level", "WARNING"], env=env)


async def _wait_for_worker(settings: Settings, proc: subprocess.Popen) -> bool:
    """True once a worker heartbeats; False if the child died first. An unreachable Redis is
    waited out (the worker and the API wait for it too), warned about once."""
    client = connect(settings.redis_url)
    warned = False
    try:
        while proc.poll() is None:
            try:
                pattern = keys.worker_heartbeat("*")
                if [k async for k in client.scan_iter(match=pattern, count=100)]:
                    return True
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                if not warned:
                    log.warning("waiting for redis at %s: %s", redacted(settings.redis_url), exc)
                    warned = True
            await asyncio.sleep(0.2)
        return False
    finally:
        await client.aclose()


async def _serve(settings: Settings) -> int:
    import uvicorn

    from tidegate.http.server_options import UVICORN_OPTIONS

    class UpServer(uvicorn.Server):
        """uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, which would kill
        this process before it stops its worker (an orphan under docker stop or systemd);
        ``up`` stops the worker and returns instead."""

        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    worker = _spawn_worker(settings)
    batch_worker = _spawn_batch_worker(settings)
    server = UpServer(uvicorn.Config(
        combined_app(settings), host=settings.host, port=settings.port,
        log_level=settings.log_level.lower(), lifespan="on", **UVICORN_OPTIONS,
    ))

    async def watch_worker() -> None:
        await asyncio.to_thread(worker.wait)
        if not server.should_exit:
            log.error("the worker exited with code %s; stopping", worker.returncode)
            server.should_exit = True

    watcher = asyncio.create_task(watch_worker())

    async def announce() -> None:
        if await _wait_for_worker(settings, worker):
            base = f"http://{settings.host}:{settings.port}"
            names = ", ".join(m.name for m in served_models(settings))
            print(f"tidegate is up: {base}  (redis {redacted(settings.redis_url)}, "
                  f"models {names})\n  try: tidegate submit \"What is the capital of "
                  f"France? Answer in one sentence.\" --stream", flush=True)

    announcer = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        await cancel_and_wait(announcer)
        for child in (worker, batch_worker):
            if child is not None and child.poll() is None:
                child.terminate()
        for child in (worker, batch_worker):
            if child is None:
                continue
            try:
                await asyncio.wait_for(asyncio.to_thread(child.wait), 30)
            except TimeoutError:
                child.kill()
        await cancel_and_wait(watcher)
    return 0 if worker.returncode in (0, -15, None) else 1


def run_up(settings: Settings, redis_url: str | None) -> int:
    with local_redis(redis_url) as url:
        return asyncio.run(_serve(settings.model_copy(update={"redis_url": url})))
