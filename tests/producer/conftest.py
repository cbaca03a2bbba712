"""Producer fixtures: the API served over real HTTP against the shared redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from producer.admission import Admission
from producer.api import create_app
from tests.asgi_server import serve
from tests.conftest import RedisServer
from tidegate.settings import Settings

MODEL = "random:tiny"  # byte-level tokenizer, 2048-token context: long prompts are cheap to make


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
