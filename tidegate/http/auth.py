"""Who may do what: API keys, the tenant each key stands for, and per-job stream tokens.

A caller presents ``Authorization: Bearer <key>``; the key maps to a tenant id (a hash prefix,
never the key), which owns the jobs it submits. A job's stream token lets a browser, which
cannot set WebSocket headers, watch that one job. With no key configured auth is off: every
caller is the tenant ``anonymous``. Admin keys (``admin_keys``, or ``admin`` on a keys-file
line) may also call the admin routes; with auth off those are open too. Keys, tokens and what derives from them are kept out of
the logs: each is handed to ``tidegate.log_redactor`` as it becomes known.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from tidegate import keys
from tidegate.http.key_file import KeyLimits, read_key_file
from tidegate.log_redactor import REDACTOR
from tidegate.settings import Settings

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the tenant of every caller while auth is off


class AuthError(Exception):
    """A refused caller; ``status``/``type`` for HTTP, ``close_code`` for WebSockets."""

    status = 401
    type = "unauthorized"
    close_code = 4401
    headers: dict[str, str] = {}


class Unauthorized(AuthError):
    """No API key, or one nobody configured."""

    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(AuthError):
    """A valid key of another tenant, or a stream token of another job."""

    status = 403
    type = "forbidden"
    close_code = 4403


@dataclass(frozen=True, slots=True)
class JobAccess:
    """What decides who may read, stream or cancel one job (from its hash)."""

    owner: str | None  # tenant id; None for jobs enqueued without one
    stream_token_hash: str | None


def tenant_of(api_key: str) -> str:
    """The tenant id a key stands for: stable, short, and useless for recovering the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def new_stream_token() -> str:
    token = secrets.token_urlsafe(32)
    remember_token(token)
    return token


def token_hash(token: str) -> str:
    """What the job hash stores of a stream token (``stream_token_hash``)."""
    return hashlib.sha256(token.encode()).hexdigest()


def remember_token(token: str) -> None:
    """Keep a stream token this process minted or was shown, and its hash, out of its logs."""
    REDACTOR.add_recent(token)
    REDACTOR.add_recent(token_hash(token))


def remember_key(api_key: str) -> None:
    """Keep an API key and everything derived from it out of this process's logs."""
    REDACTOR.add_secret(api_key)
    REDACTOR.add_secret(hashlib.sha256(api_key.encode()).hexdigest())
    REDACTOR.add_secret(tenant_of(api_key))


async def job_access(redis: aioredis.Redis, job_id: str) -> JobAccess | None:
    """The job's owner and stream-token hash; None for an unknown (or malformed) job id."""
    if not keys.is_valid_job_id(job_id):
        return None
    status, owner, hashed = await redis.hmget(
        keys.job_hash(job_id), ["status", "owner", "stream_token_hash"])
    return None if status is None else JobAccess(owner=owner, stream_token_hash=hashed)


class Auth:
    """The configured API keys, and the checks every route makes with them."""

    def __init__(self, api_keys: Iterable[str] = (), *,
                 limits: Mapping[str, KeyLimits] | None = None,
                 admin_keys: Iterable[str] = ()):
        admin_keys = list(admin_keys)
        api_keys = [*api_keys, *admin_keys]  # an admin key is an API key too
        for key in api_keys:
            remember_key(key)
        # Digests, so every comparison runs over equal lengths whatever the key's length.
        self._keys = [(hashlib.sha256(k.encode()).digest(), tenant_of(k)) for k in api_keys]
        self._admins = frozenset(tenant_of(k) for k in admin_keys)
        # Per-key rate limits (by key here, by tenant from then on: the key is not kept).
        self.limits: dict[str, KeyLimits] = {tenant_of(k): v for k, v in (limits or {}).items()}
        self._started = False

    @classmethod
    def from_settings(cls, settings: Settings) -> Auth:
        """Keys from ``api_keys`` and ``api_keys_file`` (``tidegate.http.key_file``: one a line,
        ``#`` comments, optional per-key limits; a key's later line wins)."""
        api_keys = list(settings.api_keys)
        admin_keys = list(settings.admin_keys)
        limits: dict[str, KeyLimits] = {}
        if settings.api_keys_file:
            for entry in read_key_file(settings.api_keys_file):
                (admin_keys if entry.admin else api_keys).append(entry.key)
                limits[entry.key] = entry.limits
        return cls(api_keys, limits=limits, admin_keys=admin_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def start(self) -> None:
        """At server start-up: redact secrets from the process's logs; warn if auth is off."""
        REDACTOR.install()
        if not self._started and not self.enabled:
            log.warning("auth is OFF: no API key configured (TIDEGATE_API_KEYS or "
                        "TIDEGATE_API_KEYS_FILE); anyone who can reach this port may submit, "
                        "read and cancel jobs")
        self._started = True

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant from its ``Authorization`` header; ``Unauthorized`` if none."""
        if not self.enabled:
            return ANONYMOUS
        key = _bearer(authorization)
        if key is None:
            raise Unauthorized("an API key is required: Authorization: Bearer <key>")
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, tenant in self._keys:  # no early exit: the time says nothing about which
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise Unauthorized("unknown API key")
        return found

    def admin(self, authorization: str | None) -> str:
        """The caller's tenant if it may call the admin routes: ``Unauthorized`` without a
        valid key, ``Forbidden`` for a key that is not an admin's. Auth off: anyone may."""
        tenant = self.tenant(authorization)
        if self.enabled and tenant not in self._admins:
            raise Forbidden("this route needs an admin key (TIDEGATE_ADMIN_KEYS, or 'admin' "
                            "on the key's line of the keys file)")
        return tenant

    def check_owner(self, tenant: str, access: JobAccess) -> None:
        """``Forbidden`` unless ``tenant`` owns the job (anyone does while auth is off)."""
        if self.enabled and access.owner != tenant:
            raise Forbidden("this job belongs to another tenant")

    def check_stream(self, access: JobAccess, *, authorization: str | None,
                     token: str | None) -> None:
        """May this caller watch the job: the job's stream token, or its owner's key."""
        if token is not None:
            remember_token(token)  # right or wrong, it is the caller's secret
        if token is not None and access.stream_token_hash is not None and hmac.compare_digest(
                token_hash(token), access.stream_token_hash):
            return
        if token is not None and authorization is None:
            raise Forbidden("the stream token does not match this job")
        self.check_owner(self.tenant(authorization), access)


def _bearer(authorization: str | None) -> str | None:
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    credentials = credentials.strip()
    return credentials if scheme.lower() == "bearer" and credentials else None
