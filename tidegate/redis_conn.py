"""Redis connections: one place that decides timeouts, retries and decoding."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def connect(url: str, *, blocking_ms: int = 0) -> aioredis.Redis:
    """An asyncio client that decodes to str and retries briefly across a Redis restart.

    ``blocking_ms`` is the longest BLOCK this client will issue, so the socket timeout
    stays above it.
    """
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=5,
        socket_timeout=10 + blocking_ms / 1000,
        health_check_interval=30,
        retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


def redacted(url: str) -> str:
    """The URL with any password replaced, for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
