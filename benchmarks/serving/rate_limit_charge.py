"""What one rate-limit charge costs the API process: CPU microseconds per ``RateLimiter.charge``
(the bucket script's EVALSHA, its answer parsed, the headers built) against a plain Redis GET on
the same client, sequentially and from concurrent callers, on a real redis-server.

    python -m tidegate.benchmarks.serving.rate_limit_charge --redis-url redis://127.0.0.1:6379/0 --calls 20000

CPU time (``time.process_time``: this process only) is what a busy API spends; it depends far
less on what else runs on the machine than throughput does.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from tidegate.producer.submit.rate_limit import RateLimiter, TenantLimits


async def cpu_us_per_call(call: Callable[[int], Awaitable[object]], calls: int,
                          concurrency: int) -> tuple[float, float]:
    """(CPU us per call, wall us per call) for ``calls`` calls, ``concurrency`` at a time."""
    async def lane(start: int) -> None:
        for i in range(start, calls, concurrency):
            await call(i)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane(k) for k in range(concurrency)))
    return ((time.process_time() - cpu0) * 1e6 / calls,
            (time.perf_counter() - wall0) * 1e6 / calls)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--calls", type=int, default=20_000)
    args = p.parse_args()
    redis = aioredis.Redis.from_url(args.redis_url, decode_responses=True)
    limiter = RateLimiter(TenantLimits(requests_per_s=1e9, tokens_per_min=1e12))

    async def charge(i: int) -> object:
        state = await limiter.charge(redis, f"bench{i % 64}", prompt_tokens=20, max_tokens=64)
        return state.headers() if state is not None else None

    async def get(i: int) -> object:
        return await redis.get(f"bench{i % 64}")

    await charge(0)  # loads the script
    for concurrency in (1, 32):
        for name, call in (("GET", get), ("charge", charge)):
            cpu, wall = await cpu_us_per_call(call, args.calls, concurrency)
            print(f"{name:6} concurrency {concurrency:2}: {cpu:6.1f} us CPU, {wall:6.1f} us "
                  "wall per call", flush=True)
    await redis.aclose()


if __name__ == "__main__":
    asyncio.run(main())
