"""The API's refusals: one exception carrying an error response, and the mapping from every
exception a submit or lookup can raise to it. Shared by the HTTP routes and ``/v1/stream``."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError
from starlette.responses import JSONResponse, Response

from tidegate.http.auth import AuthError
from tidegate.producer.errors import FieldError, error_body, field_errors
from tidegate.producer.submit.backlog import LaneFull
from tidegate.producer.submit.idempotency import ClaimInProgress

ModelT = TypeVar("ModelT", bound=BaseModel)


class Refusal(Exception):
    """An error response, raised anywhere in a handler and rendered in one place."""

    def __init__(self, status: int, type: str, message: str, fields: list[FieldError] | None = None,
                 *, headers: Mapping[str, str] | None = None,
                 extra: Mapping[str, object] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.fields = status, type, message, fields
        self.headers = headers
        self.extra = extra or {}  # keys some errors add to the body, e.g. a job's ``status``

    def response(self) -> JSONResponse:
        body = error_body(self.type, self.message, self.fields, **self.extra)
        return JSONResponse(body, self.status, headers=self.headers)


def validated(model: type[ModelT], body: Any) -> ModelT:
    """``body`` as ``model``; a 422 ``invalid_request`` naming each bad field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        fields = field_errors(exc)
        message = "; ".join(f"{f['field']}: {f['reason']}" for f in fields)
        raise Refusal(422, "invalid_request", message, fields) from exc


def refusal_of(exc: Exception) -> Refusal:
    """The API error for an exception a submit or lookup raised (see ``_answer``)."""
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, AuthError):
        return Refusal(exc.status, exc.type, str(exc), headers=exc.headers)
    if isinstance(exc, LaneFull):
        return _queue_full(exc)
    if isinstance(exc, ClaimInProgress):
        fields = [FieldError(field="idempotency_key", reason=str(exc))]
        return Refusal(409, "conflict", str(exc), fields)
    if isinstance(exc, RedisError):
        return _unavailable(exc)
    raise TypeError(f"no API error for {type(exc).__name__}") from exc


def _queue_full(exc: LaneFull) -> Refusal:
    fields = [FieldError(field="lane", reason=f"{exc.backlog} jobs waiting, at most "
                                              f"{exc.max_backlog}")]
    return Refusal(429, "queue_full", str(exc), fields,
                   headers={"Retry-After": str(exc.retry_after_s)},
                   extra={"lane": exc.lane, "model": exc.model})


def _unavailable(exc: RedisError) -> Refusal:
    message = f"the job store is unavailable ({type(exc).__name__}); retry later"
    return Refusal(503, "service_unavailable", message)


async def answer(handling: Awaitable[Response]) -> Response:
    """A handler's response, or the one JSON error shape for whatever refusal it raised."""
    try:
        return await handling
    except (Refusal, AuthError, LaneFull, ClaimInProgress, RedisError) as exc:
        return refusal_of(exc).response()
