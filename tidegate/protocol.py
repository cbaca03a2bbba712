"""The wire protocol: what a producer submits and every event a job emits.

Jobs travel through the lane streams as one JSON document (``Job``); events travel on the job's
pub/sub channel and event stream as one JSON object each, with ``type``, a per-job monotonically
increasing ``id`` and the type's fields. Unknown fields in anything submitted are rejected.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tidegate import untrusted_json
from tidegate.structured.grammar import GrammarError, check_format
from tidegate.structured.response_format import ResponseFormat

Lane = Literal["interactive", "batch"]
Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]

# A request may ask for at most this many new tokens; the model's context is checked separately.
MAX_TOKENS_LIMIT = 32_768
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_PROMPT_CHARS = 1_000_000
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_CHOICES = 16


def now_ms() -> int:
    return int(time.time() * 1000)


def new_job_id() -> str:
    return uuid.uuid4().hex


def _unicode_text(text: str) -> str:
    # A lone surrogate ("\ud800" as a JSON escape) validates as str but cannot be encoded as
    # UTF-8: refused here, not when the job is stored or answered.
    if not untrusted_json.valid_text(text):
        raise ValueError("holds a lone surrogate: text must be valid Unicode")
    return text


Text = Annotated[str, AfterValidator(_unicode_text)]
"""A string field of a request: valid Unicode (encodable as UTF-8)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _field_error(field: str, message: str) -> PydanticCustomError:
    """A cross-field check's error that still names a field: its ``ctx["field"]``.

    Model-level validators report an empty location; error bodies need a field to point at.
    """
    return PydanticCustomError("invalid_combination", message, {"field": field})


def _arguments_object(arguments: str) -> Any:
    """A call's arguments string as the object templates expect; the string itself when it
    is not a JSON object (a template then writes what the model wrote)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=64, description="the function called")
    arguments: str = Field(max_length=MAX_PROMPT_CHARS,
                           description="the arguments as a JSON object, in a string (OpenAI)")


class ToolCall(_Strict):
    """A call the assistant made: in an assistant message, in a result, in a stream."""

    id: str = Field(min_length=1, max_length=64, description="the call's id, which a tool "
                                                              "message's answer names")
    type: Literal["function"] = Field(default="function", description="always function")
    function: FunctionCall = Field(description="the function and its arguments")


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=10_000)
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="a JSON schema of the arguments object")
    strict: bool | None = None  # accepted: a forced call's arguments always follow the schema


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"] = "function"
    function: _Name


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice
MAX_TOOLS = 128


class ChatMessage(_Strict):
    role: Role
    content: Text = Field(default="", max_length=MAX_PROMPT_CHARS)
    tool_calls: list[ToolCall] | None = Field(
        default=None, max_length=MAX_TOOLS, description="an assistant turn's calls")
    tool_call_id: str | None = Field(default=None, max_length=64,
                                     description="a tool message: the call it answers")
    name: str | None = Field(default=None, max_length=64)

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, v: object) -> object:
        return "" if v is None else v  # an assistant turn that only calls tools

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's convention): a call's
        arguments as an object, absent fields left out."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class SamplingParams(_Strict):
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy decoding (the default).

    The filters follow Hugging Face's order (temperature, top-k, top-p, min-p); the repetition
    penalty has Hugging Face's semantics over prompt and generated tokens, the presence and
    frequency penalties OpenAI's over generated tokens only. Greedy decoding applies the
    penalties too.
    """

    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT,
                            description="the most tokens to generate; prompt + max_tokens must "
                                        "fit the model's context")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0,
                         description="keep the most likely tokens whose probabilities add up "
                                     "to top_p; 1 disables")
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    min_p: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="keep only tokens with p >= min_p * p(most likely token); 0 disables",
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0,
        description="tokens already in prompt or output: positive logits divided by it, "
        "negative ones multiplied; 1 disables",
    )
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0,
        description="subtracted once from the logit of every token already generated",
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0,
        description="subtracted from a token's logit once per time it was generated",
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="return the chosen token's logprob and this many most likely alternatives",
    )
    seed: int | None = Field(default=None, ge=0, lt=2**63,
                             description="the sampler's seed (absent: a random one); the same "
                                         "seed gives the same tokens whatever else is batched")
    stop: list[Text] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                             description="a string or a list: the text stops before the first "
                                         "stop string generated (finish_reason 'stop')")
    stop_token_ids: list[Annotated[int, Field(ge=0, strict=True)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS,
        description="generating any of these ends the job (finish_reason 'stop')",
    )
    ignore_eos: bool = Field(
        default=False, description="keep going past end-of-sequence tokens (for benchmarks)"
    )
    n: int = Field(default=1, ge=1, le=MAX_CHOICES,
                   description="choices to generate for the prompt (they share its KV blocks); "
                   "with a seed, choice k draws from seed + k")
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]] | None = (
        Field(default=None, max_length=MAX_LOGIT_BIAS,
              description="token id -> added to its logit before sampling (-100 bans it, "
              "100 all but forces it)"))
    response_format: ResponseFormat | None = Field(
        default=None, description="constrain the output: json_object, json_schema, regex, "
        "choice or grammar (text: free)")
    speculative: bool = Field(
        default=True, description="false: never draft tokens for this job, where the worker "
        "decodes speculatively (the output is the same; only its speed differs)")

    @model_validator(mode="after")
    def _format_compiles(self) -> SamplingParams:
        try:
            check_format(self.response_format)
        except GrammarError as exc:
            raise _field_error(f"response_format.{exc.path}", exc.reason) from None
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, v: object) -> object:
        # OpenAI's chat API sends ``logprobs: true``; silently reading it as 1 would mislead.
        if isinstance(v, bool):
            raise ValueError("logprobs is how many alternatives to return (0 to 20), not a boolean")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > 256 for s in v):
            raise ValueError("stop strings must be at most 256 characters")
        return v


class _PromptFields(_Strict):
    prompt: Text | None = Field(default=None, max_length=MAX_PROMPT_CHARS,
                                description="a plain prompt, no chat template (exactly one of "
                                            "prompt or messages)")
    messages: list[ChatMessage] | None = Field(
        default=None, max_length=1024,
        description="a chat, rendered with the model's chat template (exactly one of prompt "
                    "or messages)")
    tools: list[Tool] | None = Field(
        default=None, max_length=MAX_TOOLS,
        description="functions the model may call (rendered by its chat template)")
    tool_choice: ToolChoice = Field(
        default="auto", description="auto: the model decides; none: no call; required: at "
        "least one call; {type: function, function: {name}}: that call (the last two are "
        "enforced by a grammar)")
    parallel_tool_calls: bool = Field(
        default=True, description="tool_choice required: allow several calls in one reply")

    @model_validator(mode="after")
    def _one_prompt(self) -> _PromptFields:
        if (self.prompt is None) == (self.messages is None):
            raise _field_error("prompt", "give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt.strip():
            raise _field_error("prompt", "'prompt' must not be empty")
        if self.messages is not None and not self.messages:
            raise _field_error("messages", "'messages' must not be empty")
        if self.tools is not None and self.messages is None:
            raise _field_error("tools", "tools need 'messages' (a chat), not a plain 'prompt'")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise _field_error("tool_choice.function.name",
                                   f"no tool named {self.tool_choice.function.name!r}")
        elif self.tool_choice == "required" and not self.tools:
            raise _field_error("tool_choice", "'required' needs at least one tool")
        return self

    def forced_tools(self) -> bool:
        """Whether the output must be tool calls (``required`` or a named tool)."""
        return bool(self.tools) and self.tool_choice not in ("auto", "none")

    def rendered_tools(self) -> list[Tool] | None:
        """The tools the chat template shows the model (none under ``tool_choice: none``)."""
        return self.tools if self.tools and self.tool_choice != "none" else None
        return self


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # served model and adapter names


class JobRequest(_PromptFields, SamplingParams):
    """The body a producer sends: prompt or messages, sampling fields, deadline, lane, and the
    model (and LoRA adapter) to run on.

    The deadline is either absolute (``deadline_ms``, unix ms) or relative (``timeout_s``);
    with neither, the server's default timeout applies. ``model`` is a served model's name or
    alias (None: the default model), or ``base:ADAPTER``; ``lora`` names an adapter too.
    """

    model: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="a served model's name or alias (default: the first served model); "
        "'base:NAME' runs adapter NAME of model base")
    lora: str | None = Field(default=None, pattern=NAME_PATTERN,
                             description="a LoRA adapter of the model (registered on it)")

    deadline_ms: int | None = Field(default=None, gt=0,
                                    description="the deadline, unix ms (at most one of "
                                                "deadline_ms or timeout_s)")
    timeout_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600,
                                    description="the deadline, seconds from now (neither: "
                                                "TIDEGATE_DEFAULT_TIMEOUT_S)")
    lane: Lane = Field(default="interactive",
                       description="interactive (chat, served first) or batch")
    priority: int = Field(default=0, ge=-100, le=100, description="higher runs first in a lane")
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
        description="a repeated submit with the same key returns the same job (also a header)",
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> JobRequest:
        if self.deadline_ms is not None and self.timeout_s is not None:
            raise _field_error("deadline_ms", "give at most one of 'deadline_ms' or 'timeout_s'")
        fmt = self.response_format
        if self.forced_tools() and fmt is not None and fmt.type != "text":
            raise _field_error("tool_choice", "a forced tool call and a response_format cannot "
                               "both shape the output")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(**self.model_dump(include=set(SamplingParams.model_fields)))

    def to_job(self, *, model: str, default_timeout_s: float, adapter: str | None = None,
               job_id: str | None = None) -> Job:
        """The job to enqueue on ``model``'s lanes (its served name, which the request's
        ``model`` field resolved to), running ``adapter`` (None: the base model)."""
        created = now_ms()
        if self.deadline_ms is not None:
            deadline = self.deadline_ms
        else:
            deadline = created + int(1000 * (self.timeout_s or default_timeout_s))
        return Job(
            id=job_id or new_job_id(),
            prompt=self.prompt,
            messages=self.messages,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            sampling=self.sampling(),
            deadline_ms=deadline,
            lane=self.lane,
            priority=self.priority,
            created_ms=created,
            model=model,
            adapter=adapter,
        )


class Job(_PromptFields):
    """A generation job as it travels through a lane stream."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    model: str = Field(pattern=NAME_PATTERN, description="the served model's name")
    adapter: str | None = Field(default=None, pattern=NAME_PATTERN,
                                description="the LoRA adapter it runs (None: the base model)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    deadline_ms: int
    lane: Lane = "interactive"
    priority: int = Field(default=0, ge=-100, le=100)
    created_ms: int


# ---------------------------------------------------------------- events


class _Event(_Strict):
    id: int = Field(ge=1, description="per-job, monotonically increasing; a client resumes "
                                      "after the last id it saw")
    job_id: str = Field(description="the job's id")


class QueuedEvent(_Event):
    """The job was accepted and waits in its lane for a worker: always the first event."""

    type: Literal["queued"] = "queued"
    lane: Lane = Field(description="the lane it waits in: interactive or batch")


class StartedEvent(_Event):
    """A worker took the job and started running it (after a restarted event, again)."""

    type: Literal["started"] = "started"
    worker: str = Field(description="the id of the worker running it")
    prompt_tokens: int = Field(description="tokens of the prompt, after the chat template")


class TopLogprob(_Strict):
    token_id: int = Field(description="the token's id in the model's vocabulary")
    logprob: float = Field(description="its log-probability at this step")


class TokenEvent(_Event):
    """One or more tokens generated in a row: a worker writes the tokens a job generated since
    its last write as one event (one token per event for jobs that asked for logprobs)."""

    type: Literal["token"] = "token"
    index: int = Field(ge=0, description="position of its first token among generated tokens")
    choice: int | None = Field(default=None, ge=1,
                               description="jobs with n > 1: the choice (absent: the first)")
    text: str = Field(description="text these tokens complete; may be empty mid-character")
    token_ids: list[int] = Field(min_length=1, description="the tokens, in order")
    logprob: float | None = Field(
        default=None, description="the chosen token's logprob, when the job asked for logprobs"
    )
    top_logprobs: list[TopLogprob] | None = Field(
        default=None, description="the most likely tokens at this step, best first"
    )


class Usage(_Strict):
    prompt_tokens: int = Field(description="tokens of the prompt")
    completion_tokens: int = Field(description="tokens generated, all choices together")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens")


class Timings(_Strict):
    queue_ms: float = Field(description="created -> started")
    ttft_ms: float = Field(description="created -> first token")
    total_ms: float = Field(description="created -> done")
    decode_tokens_per_s: float = Field(description="tokens generated per second after the "
                                                   "first")


class Choice(_Strict):
    """One choice of a job with n > 1."""

    index: int = Field(ge=0, description="the choice's number, from 0")
    text: str = Field(description="the choice's whole text")
    finish_reason: FinishReason = Field(description="why the choice ended")
    completion_tokens: int = Field(ge=0, description="tokens the choice generated")
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="the calls read from its text (jobs with tools)")


class DoneEvent(_Event):
    """The job's end. With n > 1, ``text`` and ``finish_reason`` are the first choice's and
    ``choices`` holds every one; ``usage`` counts the tokens of all."""

    type: Literal["done"] = "done"
    finish_reason: FinishReason = Field(
        description="stop (end of sequence or a stop string), length (max_tokens), cancelled, "
                    "deadline (the deadline passed while it ran), error")
    text: str = Field(description="the whole generated text")
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="the calls read from the text (jobs with tools)")
    choices: list[Choice] | None = Field(default=None, description="jobs with n > 1: every "
                                                                   "choice")
    usage: Usage = Field(description="tokens counted")
    timings: Timings = Field(description="where the job's time went")


class ErrorEvent(_Event):
    """The job failed and will not run again: a final event."""

    type: Literal["error"] = "error"
    code: str = Field(description="why, one word: invalid_request, invalid_job, "
                                  "deadline_exceeded, dead_lettered, ...")
    message: str = Field(description="the reason in words")


class RejectedEvent(_Event):
    """The job was refused before it ran (its deadline cannot be met, or no worker serves its
    model): a final event; resubmitting later may succeed."""

    type: Literal["rejected"] = "rejected"
    reason: str = Field(description="why, one word: cannot_meet_deadline, no_worker, ...")
    message: str = Field(default="", description="the reason in words")


class RestartedEvent(_Event):
    """A worker took the job over after another died and could not continue it (its stored
    tokens were gone or no longer reproduce its text): drop any partial text seen so far."""

    type: Literal["restarted"] = "restarted"
    attempt: int = Field(ge=2, description="delivery number of this run")


class MigratedEvent(_Event):
    """A worker took the job over after another died and continues it: the tokens already
    sent stay, and token events go on from ``index`` = ``kept_tokens``."""

    type: Literal["migrated"] = "migrated"
    worker: str = Field(description="the id of the worker continuing it")
    attempt: int = Field(ge=2, description="delivery number of this run")
    kept_tokens: int = Field(ge=0, description="generated tokens carried over")


_json_string = json.encoder.encode_basestring  # C; keeps non-ASCII as is, as pydantic does


def token_event_json(event_id: int, job_id: str, index: int, text: str,
                     token_ids: list[int]) -> str:
    """A ``token`` event's JSON without building a model (a worker writes thousands a step):
    the document ``TokenEvent(...).model_dump_json(exclude_none=True)`` gives."""
    ids = str(token_ids[0]) if len(token_ids) == 1 else ",".join(map(str, token_ids))
    return (f'{{"id":{event_id},"job_id":"{job_id}","type":"token","index":{index},'
            f'"text":{_json_string(text)},"token_ids":[{ids}]}}')


Event = Annotated[
    QueuedEvent | StartedEvent | TokenEvent | DoneEvent | ErrorEvent | RejectedEvent
    | RestartedEvent | MigratedEvent,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
FINAL_EVENT_TYPES = frozenset({"done", "error", "rejected"})


def parse_event(raw: str | bytes) -> Event:
    return EVENT_ADAPTER.validate_json(raw)


def is_final(event: dict | _Event) -> bool:
    kind = event["type"] if isinstance(event, dict) else event.type  # type: ignore[attr-defined]
    return kind in FINAL_EVENT_TYPES


# ---------------------------------------------------------------- job status


JobStatus = Literal["queued", "running", "done", "error", "rejected"]


class JobResult(_Strict):
    """What ``GET /v1/jobs/{id}`` returns and what ``Handle.result()`` gives."""

    id: str = Field(description="the job's id")
    status: JobStatus = Field(description="queued, running, done, error or rejected")
    lane: Lane | None = Field(default=None, description="the lane it was queued in")
    model: str | None = Field(default=None, description="the served model's name")
    adapter: str | None = Field(default=None, description="the LoRA adapter it ran, if any")
    created_ms: int | None = Field(default=None, description="when it was submitted, unix ms")
    deadline_ms: int | None = Field(default=None, description="its deadline, unix ms")
    text: str | None = Field(default=None, description="done: the generated text")
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="done: the calls read from the text (jobs with tools)")
    choices: list[Choice] | None = Field(default=None,
                                         description="done, jobs with n > 1: every choice")
    finish_reason: FinishReason | None = Field(default=None, description="done: why it ended")
    usage: Usage | None = Field(default=None, description="done: tokens counted")
    timings: Timings | None = Field(default=None, description="done: where its time went")
    error: dict[str, str] | None = Field(
        default=None, description="error or rejected: {code, message} (a rejection's code is "
                                  "its reason)")
