"""The rate limiter's bucket script against a real redis-server: exact levels, refusals and
refills on an injected clock, Redis's own clock, atomic charges, and keys that expire."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from tidegate import keys
from tidegate.http.key_file import UNLIMITED, KeyLimits
from tidegate.producer.submit.rate_limit import (
    RateLimited,
    RateLimiter,
    RateState,
    TenantLimits,
    duration,
)

pytestmark = pytest.mark.timeout(30)

T0 = 1_700_000_000_000  # an injected clock (ms)


def limiter(**limits: float) -> RateLimiter:
    return RateLimiter(TenantLimits(**limits))


async def charge(rl: RateLimiter, redis: aioredis.Redis, tokens: int = 0, *,
                 at_ms: int | None = None, tenant: str = "t1"):  # noqa: ANN201
    return await rl.charge(redis, tenant, prompt_tokens=tokens, max_tokens=0, now_ms=at_ms)


async def test_the_requests_bucket_bursts_its_size_then_refills_one_per_interval(
        aredis: aioredis.Redis) -> None:
    rl = limiter(requests_per_s=2)  # a bucket of 2, one request back every 500 ms
    first = await charge(rl, aredis, at_ms=T0)
    assert first is not None and first.tokens is None
    assert (first.requests.limit, first.requests.remaining, first.requests.reset_ms) == (2, 1, 500)
    second = await charge(rl, aredis, at_ms=T0 + 100)  # 0.2 of a request came back meanwhile
    assert (second.requests.remaining, second.requests.reset_ms) == (0, 900)
    with pytest.raises(RateLimited) as refused:
        await charge(rl, aredis, at_ms=T0 + 100)
    assert (refused.value.limit, refused.value.retry_after_ms) == ("requests", 400)
    with pytest.raises(RateLimited) as refused:
        await charge(rl, aredis, at_ms=T0 + 499)
    assert refused.value.retry_after_ms == 1
    third = await charge(rl, aredis, at_ms=T0 + 500)
    assert (third.requests.remaining, third.requests.reset_ms) == (0, 1000)
    full_again = await charge(rl, aredis, at_ms=T0 + 60_000)  # never above the bucket's size
    assert full_again.requests.remaining == 1


async def test_the_tokens_bucket_refills_per_minute_and_refusals_take_nothing(
        aredis: aioredis.Redis) -> None:
    rl = limiter(tokens_per_min=60)  # 60 tokens, one back per second
    state = await charge(rl, aredis, 50, at_ms=T0)
    assert (state.tokens.limit, state.tokens.remaining, state.tokens.reset_ms) == (60, 10, 50_000)
    for _ in range(3):  # refused: the 10 left stay
        with pytest.raises(RateLimited) as refused:
            await charge(rl, aredis, 20, at_ms=T0)
        assert (refused.value.limit, refused.value.retry_after_ms) == ("tokens", 10_000)
    assert (await charge(rl, aredis, 10, at_ms=T0)).tokens.remaining == 0
    with pytest.raises(RateLimited) as refused:
        await charge(rl, aredis, 20, at_ms=T0 + 5_000)  # 5 back, 15 short
    assert refused.value.retry_after_ms == 15_000
    state = await charge(rl, aredis, 20, at_ms=T0 + 20_000)
    assert (state.tokens.remaining, state.tokens.reset_ms) == (0, 60_000)


async def test_both_buckets_are_charged_together_or_not_at_all(aredis: aioredis.Redis) -> None:
    rl = limiter(requests_per_s=5, tokens_per_min=600)  # 10 tokens/s
    state = await charge(rl, aredis, 590, at_ms=T0)
    assert (state.requests.remaining, state.tokens.remaining) == (4, 10)
    with pytest.raises(RateLimited) as refused:  # tokens refuse: no request is taken either
        await charge(rl, aredis, 100, at_ms=T0)
    assert refused.value.limit == "tokens" and refused.value.retry_after_ms == 9_000
    assert refused.value.state.requests.remaining == 4
    for _ in range(4):
        await charge(rl, aredis, 1, at_ms=T0)
    with pytest.raises(RateLimited) as refused:  # both short: the longer wait is named
        await charge(rl, aredis, 100, at_ms=T0)
    assert (refused.value.limit, refused.value.retry_after_ms) == ("tokens", 9_400)
    with pytest.raises(RateLimited) as refused:  # only requests short
        await charge(rl, aredis, 1, at_ms=T0)
    assert (refused.value.limit, refused.value.retry_after_ms) == ("requests", 200)


async def test_a_request_larger_than_the_bucket_is_refused_for_good(
        aredis: aioredis.Redis) -> None:
    rl = limiter(tokens_per_min=100)
    with pytest.raises(RateLimited) as refused:
        await rl.charge(aredis, "t1", prompt_tokens=5, max_tokens=96, now_ms=T0)
    error = refused.value
    assert (error.limit, error.retry_after_ms, error.status, error.type) == (
        "tokens", None, 429, "rate_limited")
    assert error.headers is not None and "Retry-After" not in error.headers
    assert error.headers["x-should-retry"] == "false"
    assert error.fields == [{"field": "max_tokens", "reason": "prompt (5 tokens) + max_tokens "
                             "(96) = 101 tokens, more than this API key's 100 tokens per minute"}]
    assert await aredis.exists(keys.rate_limit("t1")) == 0  # nothing was taken
    assert (await rl.charge(aredis, "t1", prompt_tokens=4, max_tokens=96)).tokens.remaining == 0


async def test_refusal_headers_round_the_wait_up_to_whole_seconds(
        aredis: aioredis.Redis) -> None:
    rl = limiter(requests_per_s=1, tokens_per_min=6000)
    await charge(rl, aredis, 10, at_ms=T0)
    with pytest.raises(RateLimited) as refused:
        await charge(rl, aredis, 10, at_ms=T0 + 1)
    assert refused.value.headers == {
        "Retry-After": "1", "retry-after-ms": "999",
        "x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "999ms",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "5990",
        "x-ratelimit-reset-tokens": "99ms"}
    assert refused.value.extra == {"limit": "requests", "retry_after_s": 1}


async def test_concurrent_charges_never_overdraw(aredis: aioredis.Redis) -> None:
    rl = limiter(tokens_per_min=600)  # 30 charges of 20; 20 tokens come back in 2 s
    outcomes = await asyncio.gather(*(charge(rl, aredis, 20) for _ in range(40)),
                                    return_exceptions=True)
    assert sum(isinstance(o, RateState) for o in outcomes) == 30
    assert sum(isinstance(o, RateLimited) for o in outcomes) == 10


async def test_redis_own_clock_refills_the_bucket(aredis: aioredis.Redis) -> None:
    rl = limiter(tokens_per_min=60_000)  # one token back per ms
    await charge(rl, aredis, 60_000)
    with pytest.raises(RateLimited) as refused:
        await charge(rl, aredis, 200)
    assert 0 < refused.value.retry_after_ms <= 200
    await asyncio.sleep(refused.value.retry_after_ms / 1000 + 0.01)
    assert (await charge(rl, aredis, 200)).tokens.remaining < 60_000


async def test_the_buckets_key_is_the_tenants_and_expires_when_full(
        aredis: aioredis.Redis) -> None:
    rl = limiter(requests_per_s=1, tokens_per_min=600)
    await charge(rl, aredis, 300)
    name = keys.rate_limit("t1")
    assert name == "tidegate:rate:{t1}" and await aredis.keys("*") == [name]
    assert 29_000 < await aredis.pttl(name) <= 30_000  # 300 tokens back at 10/s
    unlimited = RateLimiter(TenantLimits(), {"t2": KeyLimits(requests_per_s=UNLIMITED)})
    assert await charge(unlimited, aredis, 10**6, tenant="t2") is None
    assert await aredis.keys("*") == [name]  # a tenant without limits touches nothing


async def test_per_key_limits_override_the_defaults_one_by_one() -> None:
    rl = RateLimiter(TenantLimits(requests_per_s=5, tokens_per_min=1000), {
        "a": KeyLimits(tokens_per_min=50), "b": KeyLimits(requests_per_s=UNLIMITED),
        "c": KeyLimits()})
    assert rl.limits("a") == TenantLimits(requests_per_s=5, tokens_per_min=50)
    assert rl.limits("b") == TenantLimits(requests_per_s=UNLIMITED, tokens_per_min=1000)
    assert rl.limits("c") == rl.limits("someone else") == rl.defaults


async def test_refusals_are_counted_by_tenant_and_limit(aredis: aioredis.Redis) -> None:
    rl = limiter(requests_per_s=1)
    await charge(rl, aredis, at_ms=T0)
    for _ in range(2):
        with pytest.raises(RateLimited):
            await charge(rl, aredis, at_ms=T0)
    [family] = list(rl.collect())
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("tidegate_rate_limited_total", {"tenant": "t1", "limit": "requests"}, 2)]


@pytest.mark.parametrize(("ms", "text"), [(0, "0s"), (17, "17ms"), (1000, "1s"), (1500, "1.5s"),
                                          (59_568, "59.568s"), (360_000, "6m0s"),
                                          (61_250, "1m1.25s"), (3_723_000, "1h2m3s")])
def test_reset_durations_are_written_as_openai_writes_them(ms: int, text: str) -> None:
    assert duration(ms) == text
