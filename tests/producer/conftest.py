"""Producer fixtures: the API (alone, or with the gateway on one port as ``tidegate up`` serves
them) over real HTTP and WebSocket against the shared redis-server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette

from tests.asgi_server import serve
from tests.conftest import RedisServer
from tidegate.http.auth import Auth
from tidegate.producer.api import ProducerAPI, create_app
from tidegate.producer.submit.admission import Admission
from tidegate.settings import Settings
from tidegate.streaming.gateway import Gateway

MODEL = "random:tiny"  # byte-level tokenizer, 2048-token context: long prompts are cheap to make
SERVED = "random_tiny"  # its served name (the spec made key-safe): its lanes are named after it


@pytest.fixture(scope="session")
def admission() -> Admission:
    """Loaded once: every server in the session shares the tokenizer."""
    return Admission.for_model(MODEL)


@pytest.fixture(scope="module")
def api_server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    settings = Settings(redis_url=redis_server.url, model=MODEL)
    with serve(create_app(settings, admission=admission)) as url:
        yield url


@pytest.fixture
def api(api_server: str, redis_url: str) -> str:
    """The API's base URL, over a freshly flushed Redis."""
    return api_server


def stack_app(settings: Settings, admission: Admission) -> Starlette:
    """API and gateway mounted on one app sharing one ``Auth``, as ``tidegate up`` does."""
    auth = Auth.from_settings(settings)
    api = ProducerAPI(settings, admission=admission, auth=auth)
    gateway = Gateway(settings, auth=auth)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await api.start()
        await gateway.start()
        yield
        await gateway.stop()
        await api.stop()

    return Starlette(routes=api.routes + gateway.routes, lifespan=lifespan,
                     exception_handlers=dict(api.exception_handlers))


@contextlib.contextmanager
def serve_stack(redis_server: RedisServer, admission: Admission,
                **settings: object) -> Iterator[str]:
    """API + gateway with these settings; yields the base URL (http://; ws:// for streams)."""
    full = Settings(redis_url=redis_server.url, model=MODEL, **settings)  # type: ignore[arg-type]
    with serve(stack_app(full, admission)) as url:
        yield url


@pytest.fixture(scope="module")
def stack_server(redis_server: RedisServer, admission: Admission) -> Iterator[str]:
    """API + gateway on one port (as ``tidegate up`` serves them), one per test module."""
    with serve_stack(redis_server, admission) as url:
        yield url


@pytest.fixture
def stack(stack_server: str, redis_url: str) -> str:
    """Base URL of API + gateway, over a freshly flushed Redis."""
    return stack_server

