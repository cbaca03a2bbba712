"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) and their translation
into a tidegate ``JobRequest``.

Every field OpenAI documents for the two endpoints is known here: sampling fields map onto the
job (``response_format``, ``tools`` and ``tool_choice``, ``logit_bias``, ``seed``, logprobs;
``echo`` is the answer's), metadata and hints (``user``, ``store``, ``metadata``, ...) are
accepted and ignored, and features tidegate lacks (``n`` > 1, audio, ...) are refused with a
400 naming the field, but only when set to something other than their neutral value. A
field OpenAI does not document is refused like any other unknown field. The bodies check
shapes only; ranges are ``JobRequest``'s, whose errors are renamed back to the field sent.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tidegate.producer.errors import FieldError, field_errors
from tidegate.producer.openai_compat.errors import OpenAIError, from_fields, invalid, unsupported
from tidegate.protocol import JobRequest, Tool, ToolCall, ToolChoice
from tidegate.structured.grammar import GrammarError, check_format
from tidegate.structured.response_format import ResponseFormat

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored: no padding is sent


class _Request(_Body):
    """Fields both endpoints share, OpenAI's and tidegate's extensions."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # ignored
    # tidegate extensions (see POST /v1/jobs)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    timeout_s: float | None = None
    lane: str | None = None
    priority: int | None = None
    ignore_eos: bool | None = None  # as vLLM's and llama-server's routes: generate to max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Refuse features tidegate lacks when set to anything but their neutral value."""
        try:
            check_format(self.response_format)
        except GrammarError as exc:  # 422, as the native API: the format cannot be compiled
            raise OpenAIError(422, f"response_format.{exc.path}: {exc.reason}",
                              param=f"response_format.{exc.path}",
                              code="invalid_response_format") from exc

    def _job_fields(self) -> dict[str, Any]:
        """The sampling, deadline and lane fields of the job, as given (None: the default)."""
        given = self.model_dump(include={
            "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "timeout_s", "lane", "priority", "ignore_eos"},
            exclude_none=True)
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        fields = {**given, "temperature": temperature}
        if self.n is not None:
            fields["n"] = self.n
        if self.response_format is not None:
            fields["response_format"] = self.response_format
        if self.logit_bias:
            fields["logit_bias"] = self.logit_bias  # "123": 5.0 -> 123: 5.0 on validation
        return fields


class CompletionRequest(_Request):
    """``POST /v1/completions``: a plain prompt, continued."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs (the prompt's logprobs) is not "
                              "supported; echo alone is")
        if self.suffix is not None:
            raise unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None  # 0: the chosen tokens' logprobs, no alternatives

    @property
    def echo_text(self) -> str:
        """The prompt, when the answer echoes it before the completion."""
        if not self.echo:
            return ""
        return self.prompt if isinstance(self.prompt, str) else str(self.prompt[0])

    @property
    def param_names(self) -> dict[str, str]:
        return {}  # the job's field names are the request's

    def job_request(self) -> JobRequest:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise unsupported("prompt", "prompt must be a string or a list of one string "
                                  "(batches and token-id prompts are not supported)")
            prompt = prompt[0]
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        fields = {**self._job_fields(), "prompt": prompt, "max_tokens": max_tokens}
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return _validated_job(fields, self.param_names)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # ignored
    refusal: str | None = None  # ignored (an assistant turn the model refused)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, v: object) -> object:
        # Say what is wrong with a non-text part, rather than pydantic's union error list.
        for i, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i} has type {kind!r}; only 'text' parts are supported")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_job_message(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: a conversation, answered by the assistant."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # hints and metadata with no effect here
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("audio", "prediction", "web_search_options", "moderation"):
            if getattr(self, name):
                raise unsupported(name, f"{name} is not supported")
        if self.functions or self.function_call not in (None, "none"):
            raise unsupported("functions" if self.functions else "function_call",
                              "the deprecated functions API is not supported; use tools")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "only the 'text' modality is supported")
        for i, message in enumerate(self.messages):
            if message.function_call:
                raise unsupported(f"messages.{i}.function_call",
                                  "the deprecated function_call is not supported; use tool_calls")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def param_names(self) -> dict[str, str]:
        """The request field each job field came from, where the names differ."""
        given = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"max_tokens": given, "logprobs": "top_logprobs"}

    @property
    def offers_tools(self) -> bool:
        """Whether the answer reads tool calls out of the reply."""
        return bool(self.tools) and self.tool_choice != "none"

    def job_request(self) -> JobRequest:
        fields = {**self._job_fields(), "messages": [m.as_job_message() for m in self.messages]}
        if self.tools:
            fields["tools"] = self.tools
            fields["tool_choice"] = self.tool_choice or "auto"
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        if max_tokens is not None:  # else tidegate's default, capped to the room left
            fields["max_tokens"] = max_tokens
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return _validated_job(fields, self.param_names)


def parse_body(kind: type[CompletionRequest] | type[ChatCompletionRequest],
               body: Any) -> CompletionRequest | ChatCompletionRequest:
    """The body as ``kind``, its features checked; ``OpenAIError`` (400) naming the field."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    try:
        request = kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "extra_forbidden":
            name = ".".join(str(part) for part in first["loc"])
            raise invalid(name, f"Unrecognized request argument supplied: {name}",
                          code="unknown_parameter") from exc
        raise from_fields(_untagged(field_errors(exc))) from exc
    request.check_supported()
    return request


def _untagged(fields: list[FieldError]) -> list[FieldError]:
    """Drop the union-member tags pydantic puts in error paths (``stop.list[str].0``)."""
    tags = {"str", "int", "float", "bool"}

    def clean(path: str) -> str:
        return ".".join(p for p in path.split(".") if p not in tags and "[" not in p)

    return [FieldError(field=clean(f["field"]), reason=f["reason"]) for f in fields]


def _validated_job(fields: dict[str, Any], rename: dict[str, str]) -> JobRequest:
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise from_fields(field_errors(exc), rename) from exc


__all__ = ["ChatCompletionRequest", "CompletionRequest", "OpenAIError", "parse_body"]
