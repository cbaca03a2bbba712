"""The errors a producer sees, and the JSON error body they travel in.

Every error response of the API is one shape,
``{"error": {"type": str, "message": str, "fields": [{"field": str, "reason": str}]}}``;
the client turns each into one of the exceptions below, so callers catch a named error and
never parse a status code.
"""

from __future__ import annotations

from typing import Any, TypedDict

from pydantic import ValidationError


class FieldError(TypedDict):
    field: str  # dotted path into the request body, e.g. "messages.0.role"
    reason: str


class TidegateError(Exception):
    """Base of every error the client raises; ``type`` is the error body's ``type``."""

    default_type = "error"

    def __init__(self, message: str, *, type: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.type = type or self.default_type
        self.status = status


class InvalidRequest(TidegateError):
    """The request was refused as given (400/413/422): ``fields`` says what to change."""

    default_type = "invalid_request"

    def __init__(
        self,
        fields: list[FieldError],
        message: str | None = None,
        *,
        type: str | None = None,
        status: int | None = None,
    ):
        text = message or "; ".join(f"{f['field']}: {f['reason']}" for f in fields)
        super().__init__(text or "invalid request", type=type, status=status)
        self.fields = fields

    @classmethod
    def from_validation(cls, exc: ValidationError) -> InvalidRequest:
        return cls(field_errors(exc))


class JobNotFound(TidegateError):
    """No job with that id: never submitted, malformed, or its record has expired."""

    default_type = "not_found"


class ModelNotFound(JobNotFound):
    """The request names a model, or an adapter of one, that the service does not serve (404
    ``model_not_found``): ``fields`` names the request field (``model`` or ``lora``)."""

    default_type = "model_not_found"

    def __init__(self, message: str, *, fields: list[FieldError] | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.fields = fields or []


class ServiceUnavailable(TidegateError):
    """The API, the gateway or Redis could not be reached; retrying later may succeed."""

    default_type = "service_unavailable"


class Unauthorized(TidegateError):
    """No API key, or one the service does not know (401, or WebSocket close 4401)."""

    default_type = "unauthorized"


class Forbidden(TidegateError):
    """The job belongs to another tenant, or the stream token is not its own (403 / 4403)."""

    default_type = "forbidden"


class Conflict(TidegateError):
    """The job cannot do that now (409): e.g. cancelling a job that already finished, whose
    final status is ``job_status``."""

    default_type = "conflict"

    def __init__(self, message: str, *, job_status: str | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.job_status = job_status


class QueueFull(TidegateError):
    """The lane is at capacity (429); submit again after ``retry_after_s``."""

    default_type = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class RateLimitExceeded(QueueFull):
    """The API key's rate limit (429 ``rate_limited``): ``limit`` is "requests" or "tokens";
    ``retry_after_s`` None means the request can never fit (its tokens exceed the limit)."""

    default_type = "rate_limited"

    def __init__(self, message: str, *, limit: str | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.limit = limit


def field_errors(exc: ValidationError) -> list[FieldError]:
    """One ``FieldError`` per pydantic error, located by a dotted path.

    Cross-field checks have no location of their own; they name their field in
    ``ctx["field"]`` (``tidegate.protocol``).
    """
    out: list[FieldError] = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(part) for part in err["loc"])
        field = path or str((err.get("ctx") or {}).get("field", "body"))
        reason = err["msg"].removeprefix("Value error, ")
        out.append(FieldError(field=field, reason=reason))
    return out


def error_body(type: str, message: str, fields: list[FieldError] | None = None,
               **extra: object) -> dict:
    """The one JSON shape of every API error (``extra``: keys some errors add, e.g. ``status``)."""
    return {"error": {"type": type, "message": message, "fields": fields or [], **extra}}


def error_from_response(status: int, body: Any, retry_after: str | None = None) -> TidegateError:
    """The exception for an API error response (``body`` as parsed JSON, or anything else)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {}
    message = str(err.get("message") or f"HTTP {status}")
    kind = str(err.get("type") or "") or None
    if status in (400, 413, 422):
        fields = [FieldError(field=str(f.get("field", "")), reason=str(f.get("reason", "")))
                  for f in err.get("fields") or [] if isinstance(f, dict)]
        return InvalidRequest(fields, message, type=kind, status=status)
    if status == 401:
        return Unauthorized(message, type=kind, status=status)
    if status == 403:
        return Forbidden(message, type=kind, status=status)
    if status == 404 and kind == "model_not_found":
        fields = [FieldError(field=str(f.get("field", "")), reason=str(f.get("reason", "")))
                  for f in err.get("fields") or [] if isinstance(f, dict)]
        return ModelNotFound(message, fields=fields, type=kind, status=status)
    if status == 404:
        return JobNotFound(message, type=kind, status=status)
    if status == 409:
        job_status = err.get("status")
        return Conflict(message, job_status=job_status if isinstance(job_status, str) else None,
                        type=kind, status=status)
    if status == 429 and kind == "rate_limited":
        limit = err.get("limit")
        return RateLimitExceeded(message, limit=limit if isinstance(limit, str) else None,
                                 retry_after_s=_seconds(retry_after), type=kind, status=status)
    if status == 429:
        return QueueFull(message, retry_after_s=_seconds(retry_after), type=kind, status=status)
    if status in (502, 503, 504):
        return ServiceUnavailable(message, type=kind, status=status)
    return TidegateError(message, type=kind, status=status)


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date; callers fall back to their own backoff
