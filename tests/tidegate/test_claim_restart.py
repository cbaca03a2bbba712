"""Claims go on through Redis restarts: a pipeline's retry after a dropped connection does not
load its scripts again, so a restarted Redis (script cache empty) refused the claim's EVALSHA
with NoScriptError, which killed the worker's intake."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.conftest import RedisServer
from tidegate.jobstore import claim_many
from tidegate.redis_conn import connect


async def test_claims_survive_redis_restarts(redis_server: RedisServer) -> None:
    redis = connect(redis_server.url)
    stop = asyncio.Event()
    refused: list[BaseException] = []
    claims = 0

    async def claim_forever() -> None:
        nonlocal claims
        while not stop.is_set():
            try:
                await claim_many(redis, [(f"job-{i}", 1) for i in range(8)], "w1")
                claims += 1
            except NoScriptError as exc:
                refused.append(exc)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(claim_forever()) for _ in range(4)]
    try:
        for _ in range(4):
            await asyncio.sleep(0.5)
            redis_server.kill()
            await asyncio.sleep(0.3)
            redis_server.start()
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await redis.aclose()
    assert claims > 0 and refused == []
