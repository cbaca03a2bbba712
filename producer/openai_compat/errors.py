"""How tidegate's failures look to OpenAI clients: one exception, ``OpenAIError``, rendered as
``{"error": {"message", "type", "param", "code"}}``, and the mapping onto it of every way a job
can fail (a refused submission, a worker's ``rejected`` or ``error`` event).

The status decides which exception the official ``openai`` client raises (400
``BadRequestError``, 404 ``NotFoundError``, 429 ``RateLimitError``, 5xx
``InternalServerError``); ``code`` keeps tidegate's reason for callers that look closer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

from tidegate.producer.errors import FieldError

# OpenAI's error ``type`` for each status it uses.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}
# A worker's ``rejected`` reasons that mean "too busy right now": retrying later may succeed.
BUSY_REASONS = frozenset({"cannot_meet_deadline", "queue_full", "overloaded"})


class OpenAIError(Exception):
    """An error answer in OpenAI's shape; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else
                                       "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def invalid(param: str | None, message: str, *, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_value")


def model_not_found(model: str, served: Sequence[str]) -> OpenAIError:
    message = f"The model {model!r} does not exist; this server serves {', '.join(served)}"
    return OpenAIError(404, message, param="model", code="model_not_found")


def from_fields(fields: list[FieldError], rename: Mapping[str, str] | None = None,
                *, code: str | None = "invalid_value") -> OpenAIError:
    """A 400 for field errors (tidegate's or pydantic's), ``param`` the first field at fault,
    renamed to the field the client sent (``rename``: tidegate name -> OpenAI name)."""
    rename = rename or {}

    def openai_name(field: str) -> str:
        head, _, rest = field.partition(".")
        return rename.get(head, head) + (f".{rest}" if rest else "")

    named = [(openai_name(f["field"]), f["reason"]) for f in fields]
    message = "; ".join(f"{name}: {reason}" for name, reason in named) or "invalid request"
    return invalid(named[0][0] if named else None, message, code=code)


def from_refusal(status: int, type: str, message: str, fields: list[FieldError] | None,
                 headers: Mapping[str, str] | None = None,
                 rename: Mapping[str, str] | None = None) -> OpenAIError:
    """A submission the producer API refused (``tidegate.producer.api.Refusal``), in OpenAI's shape."""
    if status == 422:
        status = 400  # OpenAI answers 400 for every request it cannot take as given
    if status == 400 and fields:
        return from_fields(fields, rename, code="invalid_value" if type == "invalid_request" else type)
    if status == 404 and fields:  # model_not_found: the model, or its adapter's field
        return OpenAIError(404, message, param=fields[0]["field"], code=type, headers=headers)
    return OpenAIError(status, message, code=type, headers=headers)


def from_rejected(reason: str, message: str, *, retry_after_s: int) -> OpenAIError:
    """A worker's ``rejected`` event: busy -> 429 (retry after ``retry_after_s``), the deadline
    passed -> 504, else 503."""
    text = message or f"the job was rejected: {reason}"
    if reason in BUSY_REASONS:
        return OpenAIError(429, text, code=reason, headers={"Retry-After": str(retry_after_s)})
    if reason in ("deadline_exceeded", "deadline"):
        return OpenAIError(504, text, code=reason)
    return OpenAIError(503, text, code=reason)


def from_error_event(code: str, message: str) -> OpenAIError:
    """A worker's ``error`` event: a request no worker can serve is the client's (400)."""
    if code == "invalid_request":
        return OpenAIError(400, message, code=code)
    return OpenAIError(500, message or "the job failed", code=code)
