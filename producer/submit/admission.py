"""Admission: whether a request fits the model, decided before anything touches Redis.

The prompt (or the chat messages, rendered by the model's chat template) is tokenized with the
model's own tokenizer. A prompt that leaves no room to generate, or a ``max_tokens`` that would
run past the context or the service's ``max_output_tokens``, is refused with the field to change.
Plain Python: no torch, no Redis.
"""

from __future__ import annotations

from tidegate.model_files.chat_template import ChatTemplateError
from tidegate.model_files.model_source import resolve_model
from tidegate.model_files.tokenizer import Tokenizer, load_tokenizer
from tidegate.protocol import MAX_TOKENS_LIMIT, JobRequest
from tidegate.structured.grammar import GrammarError, check_format
from tidegate.structured.response_format import GrammarFormat
from tidegate.structured.tool_calls import forced_call_grammar

# Prompts (or chats, their contents added up) of at most this many characters are admitted on
# the event loop: tokenizing them takes 20-400 us, less than or about what handing the work to a
# worker thread and back costs. The tokenizer holds the GIL while it encodes, so a thread buys
# no parallelism either way; longer prompts still go to one, so the loop can run between the
# Python steps of their admission (chat rendering, the copy) instead of waiting for all of it.
INLINE_PROMPT_CHARS = 2048


class AdmissionError(Exception):
    """A request the model cannot serve; ``field`` names the request field to change.

    ``type`` is the API error type: ``context_length_exceeded``, or ``invalid_request`` for
    messages the chat template refuses.
    """

    def __init__(self, field: str, reason: str, *, type: str = "context_length_exceeded"):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.type = type


class Admission:
    """Checks requests against one model's tokenizer and context length."""

    def __init__(self, tokenizer: Tokenizer, max_context: int | None = None,
                 max_output_tokens: int = MAX_TOKENS_LIMIT):
        self.tokenizer = tokenizer
        self.max_context = max_context if max_context is not None else tokenizer.max_context
        # The operator's bound on one job's output (TIDEGATE_MAX_OUTPUT_TOKENS): with the
        # context it bounds the text a job stores in Redis.
        self.max_output_tokens = max_output_tokens

    @classmethod
    def for_model(cls, model: str, max_output_tokens: int = MAX_TOKENS_LIMIT) -> Admission:
        """Admission for a model spec (``smollm2``, a path, a Hub id, ``random:<preset>``): a
        Hub id's tokenizer and config only are fetched.

        Raises ``tidegate.model_files.model_source.ModelLoadError`` when the model cannot be found.
        """
        return cls(load_tokenizer(resolve_model(model, "tokenizer")),
                   max_output_tokens=max_output_tokens)

    def check(self, request: JobRequest) -> JobRequest:
        """The request to enqueue, or ``AdmissionError`` if it cannot fit.

        A request that did not set ``max_tokens`` gets the default capped to the room its
        prompt leaves, rather than a refusal over a field it never sent. CPU-bound on long
        prompts: in async code, call it from a worker thread unless ``is_quick``.
        """
        return self.admit(request)[0]

    def admit(self, request: JobRequest) -> tuple[JobRequest, list[int]]:
        """``check``, with the prompt's token ids (the rate limiter charges their count;
        prefix routing hashes them). A forced tool call (``tool_choice`` required or named)
        comes back as the job's grammar."""
        request = self._checked_tools(request)
        self._check_logit_bias(request)
        prompt_ids = self.prompt_ids(request)
        prompt_tokens = len(prompt_ids)
        field = "prompt" if request.prompt is not None else "messages"
        if prompt_tokens >= self.max_context:
            raise AdmissionError(
                field,
                f"the prompt is {prompt_tokens} tokens; the model's context is "
                f"{self.max_context} tokens, which leaves no room to generate",
            )
        room = self.max_context - prompt_tokens
        if "max_tokens" not in request.model_fields_set:
            if request.max_tokens > min(room, self.max_output_tokens):
                return request.model_copy(
                    update={"max_tokens": min(room, self.max_output_tokens)}), prompt_ids
            return request, prompt_ids
        if request.max_tokens > self.max_output_tokens:
            raise AdmissionError(
                "max_tokens",
                f"max_tokens ({request.max_tokens}) is above this service's limit of "
                f"{self.max_output_tokens} new tokens per job",
                type="invalid_request",
            )
        if request.max_tokens > room:
            raise AdmissionError(
                "max_tokens",
                f"prompt ({prompt_tokens} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"the model's context of {self.max_context} tokens; at most {room} fit",
            )
        return request, prompt_ids

    def _checked_tools(self, request: JobRequest) -> JobRequest:
        if not request.rendered_tools():
            return request
        fmt = self.tokenizer.tool_format
        if fmt is None:
            raise AdmissionError("tools", "this model's chat template has no tool-call format "
                                 "(it never renders tools), so it cannot call tools",
                                 type="invalid_request")
        if not request.forced_tools():
            return request
        grammar = forced_call_grammar(fmt, request.tools or [], request.tool_choice,
                                      request.parallel_tool_calls)
        try:
            check_format(GrammarFormat(grammar=grammar))
        except GrammarError as exc:
            raise AdmissionError("tools", f"a tool's parameters cannot be enforced: "
                                 f"{exc.reason}", type="invalid_request") from exc
        return request.model_copy(update={"response_format": GrammarFormat(grammar=grammar)})

    def _check_logit_bias(self, request: JobRequest) -> None:
        vocab = self.tokenizer.vocab_size
        for token in request.logit_bias or {}:
            if token >= vocab:
                raise AdmissionError("logit_bias", f"token id {token} is not in the model's "
                                     f"vocabulary of {vocab} tokens", type="invalid_request")

    @staticmethod
    def is_quick(request: JobRequest) -> bool:
        """Whether ``check`` is cheap enough to run on the event loop (a short prompt)."""
        if request.prompt is not None:
            return len(request.prompt) <= INLINE_PROMPT_CHARS
        if request.messages is None or len(request.messages) > 16:
            return False
        return sum(len(m.content) for m in request.messages) <= INLINE_PROMPT_CHARS

    def count_prompt_tokens(self, request: JobRequest) -> int:
        """Tokens of the prompt as the worker will see it (chat messages rendered)."""
        return len(self.prompt_ids(request))

    def prompt_ids(self, request: JobRequest) -> list[int]:
        """The prompt's token ids as the worker will see them (chat messages rendered)."""
        try:
            return self.tokenizer.encode_prompt(request.prompt, request.messages,
                                                request.rendered_tools())
        except ChatTemplateError as exc:  # e.g. a template that insists roles alternate
            raise AdmissionError("messages", str(exc), type="invalid_request") from exc
