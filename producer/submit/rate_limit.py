"""Per-tenant rate limits: requests per second and tokens per minute for each API key, as two
token buckets kept in Redis, so every API replica draws on the same buckets.

One Lua script reads a tenant's two buckets, refills them for the time since each was last
charged (Redis's clock; tests may give one), and takes one request and the request's tokens
only if both buckets hold them: atomic, so concurrent submits on any number of replicas never
overdraw, and a refused submit takes nothing. The requests bucket holds one second's worth
(at least one request), the tokens bucket one minute's. A submit is charged prompt tokens +
``max_tokens``, as OpenAI counts at admission; tokens a job leaves unused are not refunded
(it ends on a worker, far from the bucket, and a refund would let bursts overshoot). A
missing bucket is a full one and the key expires once both would be full again, so an idle
tenant holds no memory; a tenant without limits costs no Redis call at all.

A refusal is ``RateLimited``: a ``Refusal`` (429 ``rate_limited``) naming the limit, with
``Retry-After`` and the ``x-ratelimit-*`` headers OpenAI clients read, which accepted submits
carry too. Refusals are counted per tenant and limit for ``/metrics``.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from prometheus_client.core import Metric
from redis.exceptions import NoScriptError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidegate import keys
from tidegate.http.auth import Auth
from tidegate.http.key_file import UNLIMITED, KeyLimits
from tidegate.operations.metric_doc import MetricDoc
from tidegate.producer.errors import FieldError
from tidegate.producer.submit.refusal import Refusal
from tidegate.settings import Settings

# KEYS[1]: the tenant's buckets (tidegate.keys.rate_limit), fields r/r_ms (requests: level, when
# read) and t/t_ms (tokens). ARGV: requests refilled per ms, requests capacity, tokens refilled
# per ms, tokens capacity, this request's tokens, now in ms ('': Redis's clock). A capacity of
# 0 means no such limit. Returns {allowed 0|1, refusing bucket (0 none, 1 requests, 2 tokens),
# ms until the refused charge fits (-1: never, it exceeds the capacity), then for each bucket
# its whole units left and ms until full (-1, 0 for a bucket without a limit)}.
_CHARGE_LUA = """
local now = tonumber(ARGV[6])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local stored = redis.call('HMGET', KEYS[1], 'r', 'r_ms', 't', 't_ms')
local buckets = {
  {rate = tonumber(ARGV[1]), cap = tonumber(ARGV[2]), cost = 1, level = 'r', at = 'r_ms', i = 1},
  {rate = tonumber(ARGV[3]), cap = tonumber(ARGV[4]), cost = tonumber(ARGV[5]), level = 't',
   at = 't_ms', i = 3},
}
local allowed, refusing, retry = 1, 0, 0
for n, b in ipairs(buckets) do
  if b.cap > 0 then
    local level, since = tonumber(stored[b.i]), tonumber(stored[b.i + 1])
    if level == nil or since == nil then
      b.now = b.cap
    else
      b.now = math.min(b.cap, level + math.max(0, now - since) * b.rate)
    end
    if b.now + 1e-9 < b.cost then
      allowed = 0
      local wait = -1
      if b.cost <= b.cap then wait = math.ceil((b.cost - b.now) / b.rate - 1e-9) end
      if refusing == 0 or (retry ~= -1 and (wait == -1 or wait > retry)) then
        refusing, retry = n, wait
      end
    end
  end
end
local out = {allowed, refusing, retry}
local ttl = 1
for _, b in ipairs(buckets) do
  if b.cap > 0 then
    if allowed == 1 then
      b.now = math.max(0, b.now - b.cost)
      redis.call('HSET', KEYS[1], b.level, string.format('%.17g', b.now), b.at, now)
    end
    local full_ms = math.ceil((b.cap - b.now) / b.rate - 1e-9)
    ttl = math.max(ttl, full_ms)
    out[#out + 1] = math.floor(b.now + 1e-9)
    out[#out + 1] = full_ms
  else
    out[#out + 1] = -1
    out[#out + 1] = 0
  end
end
if allowed == 1 then redis.call('PEXPIRE', KEYS[1], ttl) end
return out
"""
_CHARGE_SHA = hashlib.sha1(_CHARGE_LUA.encode()).hexdigest()
LIMITS = ("requests", "tokens")  # the ``limit`` a refusal names, bucket 1 and 2 of the script
RATE_LIMITED = MetricDoc("tidegate_rate_limited", "counter", "Submits refused (429 rate_limited) "
                         "by this API process, per tenant and the limit that refused them.",
                         ("tenant", "limit"))


class ScriptRunner(Protocol):
    """What the limiter needs of a Redis client (the API's ``Batched`` is one)."""

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...
    async def script_load(self, script: str) -> Any: ...


@dataclass(frozen=True)  # not slotted: cached_property needs a __dict__
class TenantLimits:
    """One tenant's limits in force; ``UNLIMITED`` (infinity) for none."""

    requests_per_s: float = UNLIMITED
    tokens_per_min: float = UNLIMITED

    @property
    def unlimited(self) -> bool:
        return math.isinf(self.requests_per_s) and math.isinf(self.tokens_per_min)

    @cached_property
    def script_args(self) -> tuple[str | int, ...]:
        """Refill per ms and capacity of each bucket, as the script takes them (0: none)."""
        args: list[str | int] = []
        for per_ms, capacity in ((self.requests_per_s / 1000, self.requests_per_s),
                                 (self.tokens_per_min / 60_000, self.tokens_per_min)):
            if math.isinf(per_ms):
                args += ["0", 0]
            else:  # whole units: a bucket of 2.5 requests would only ever admit 2 at once
                args += [repr(per_ms), max(1, math.floor(capacity))]
        return tuple(args)


@dataclass(frozen=True, slots=True)
class BucketReading:
    """One bucket as a charge left it (or found it, when refused)."""

    limit: int  # its capacity
    remaining: int  # whole units left
    reset_ms: int  # until it is full again


@dataclass(frozen=True, slots=True)
class RateState:
    """A tenant's buckets after a charge; None for a bucket without a limit."""

    requests: BucketReading | None
    tokens: BucketReading | None

    def headers(self) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers OpenAI sends (its reset is a duration, e.g. "6m0s")."""
        out: dict[str, str] = {}
        for name, reading in (("requests", self.requests), ("tokens", self.tokens)):
            if reading is not None:
                out[f"x-ratelimit-limit-{name}"] = str(reading.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(reading.remaining)
                out[f"x-ratelimit-reset-{name}"] = duration(reading.reset_ms)
        return out


class RateLimited(Refusal):
    """A submit over its tenant's ``limit`` ("requests" or "tokens"): 429 ``rate_limited``,
    to retry after ``retry_after_ms`` (None: it can never fit, the tokens it asks exceed the
    bucket; ``x-should-retry: false`` tells the OpenAI client not to retry)."""

    def __init__(self, limit: str, retry_after_ms: int | None, state: RateState, message: str,
                 fields: list[FieldError] | None = None):
        headers = state.headers()
        retry_after_s = None
        if retry_after_ms is None:
            headers["x-should-retry"] = "false"
        else:
            retry_after_s = max(1, math.ceil(retry_after_ms / 1000))
            headers["Retry-After"] = str(retry_after_s)
            headers["retry-after-ms"] = str(retry_after_ms)  # the OpenAI client prefers it
        super().__init__(429, "rate_limited", message, fields, headers=headers,
                         extra={"limit": limit, "retry_after_s": retry_after_s})
        self.limit, self.retry_after_ms, self.state = limit, retry_after_ms, state


class RateLimiter:
    """Every tenant's limits (keys-file entries over the settings' defaults) and the charge
    each submit makes against them."""

    def __init__(self, defaults: TenantLimits = TenantLimits(),
                 per_tenant: Mapping[str, KeyLimits] | None = None):
        self.defaults = defaults
        self._limits = {tenant: _resolved(own, defaults)
                        for tenant, own in (per_tenant or {}).items()}
        self.refused: Counter[tuple[str, str]] = Counter()  # (tenant, limit) -> refusals

    @classmethod
    def from_settings(cls, settings: Settings, auth: Auth) -> RateLimiter:
        """Defaults from ``TIDEGATE_RATE_LIMIT_*`` (unset: unlimited), per-key limits from the
        keys file. With auth off the one tenant, ``anonymous``, gets the defaults."""
        defaults = TenantLimits(
            requests_per_s=settings.rate_limit_requests_per_s or UNLIMITED,
            tokens_per_min=settings.rate_limit_tokens_per_min or UNLIMITED)
        return cls(defaults, auth.limits)

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self.defaults)

    async def charge(self, redis: ScriptRunner, tenant: str, *, prompt_tokens: int,
                     max_tokens: int, now_ms: int | None = None) -> RateState | None:
        """Take one request and ``prompt_tokens + max_tokens`` tokens from the tenant's buckets;
        the state they are left in (None: the tenant has no limit). Raises ``RateLimited``
        (nothing taken) or ``RedisError``. ``now_ms``: a clock for tests (else Redis's)."""
        limits = self.limits(tenant)
        if limits.unlimited:
            return None
        cost = prompt_tokens + max_tokens
        args = [*limits.script_args, cost, "" if now_ms is None else now_ms]
        try:
            answer = await redis.evalsha(_CHARGE_SHA, 1, keys.rate_limit(tenant), *args)
        except NoScriptError:  # a fresh (or flushed) Redis: load it once, then as before
            await redis.script_load(_CHARGE_LUA)
            answer = await redis.evalsha(_CHARGE_SHA, 1, keys.rate_limit(tenant), *args)
        allowed, refusing, retry_ms, *readings = (int(x) for x in answer)
        state = _state(readings, limits)
        if allowed:
            return state
        limit = LIMITS[refusing - 1]
        self.refused[(tenant, limit)] += 1
        raise _refusal(limit, None if retry_ms < 0 else retry_ms, state, limits,
                       prompt_tokens, max_tokens)

    def collect(self) -> Iterator[Metric]:
        """``tidegate_rate_limited_total{tenant, limit}`` (a Prometheus collector)."""
        counter = RATE_LIMITED.family()
        for (tenant, limit), count in sorted(self.refused.items()):
            counter.add_metric([tenant, limit], count)
        yield counter


def with_headers(app: ASGIApp, headers: Mapping[str, str]) -> ASGIApp:
    """``app`` with ``headers`` added to its response (for answers built as ASGI apps)."""
    extra = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    if not extra:
        return app

    async def headed(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await app(scope, receive, send_with_headers)

    return headed


def duration(ms: int) -> str:
    """A span as OpenAI's reset headers (and Go) write it: 0s, 20ms, 1s, 1.5s, 6m0s, 1h2m3s."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = str(rest // 1000) if rest % 1000 == 0 else f"{rest / 1000:.3f}".rstrip("0")
    text = f"{seconds}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def _resolved(own: KeyLimits, defaults: TenantLimits) -> TenantLimits:
    return TenantLimits(
        requests_per_s=defaults.requests_per_s if own.requests_per_s is None
        else own.requests_per_s,
        tokens_per_min=defaults.tokens_per_min if own.tokens_per_min is None
        else own.tokens_per_min)


def _state(readings: list[int], limits: TenantLimits) -> RateState:
    """The script's (remaining, ms until full) per bucket; remaining -1: no such limit."""
    capacities = limits.script_args[1::2]
    buckets = [None if remaining < 0 else BucketReading(int(capacity), remaining, reset_ms)
               for remaining, reset_ms, capacity in zip(readings[0::2], readings[1::2],
                                                        capacities, strict=True)]
    return RateState(requests=buckets[0], tokens=buckets[1])


def _refusal(limit: str, retry_ms: int | None, state: RateState, limits: TenantLimits,
             prompt_tokens: int, max_tokens: int) -> RateLimited:
    cost = prompt_tokens + max_tokens
    if limit == "requests":
        reading = state.requests
        message = (f"rate limit reached for this API key: {limits.requests_per_s:g} requests "
                   f"per second ({reading.limit if reading else 0} at once)")
    elif retry_ms is None:
        reason = (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {cost} tokens, "
                  f"more than this API key's {limits.tokens_per_min:g} tokens per minute")
        return RateLimited(limit, None, state, f"request too large: {reason}; lower max_tokens "
                           "or shorten the prompt", [FieldError(field="max_tokens",
                                                                reason=reason)])
    else:
        message = (f"rate limit reached for this API key: {limits.tokens_per_min:g} tokens per "
                   f"minute; this request needs {cost} (prompt {prompt_tokens} + max_tokens "
                   f"{max_tokens})")
    retry_s = max(1, math.ceil((retry_ms or 0) / 1000))
    return RateLimited(limit, retry_ms, state, f"{message}; retry in {retry_s} s")
