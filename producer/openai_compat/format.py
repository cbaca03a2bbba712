"""OpenAI's response shapes: whole bodies (``chat.completion``, ``text_completion``), stream
chunks, logprobs, and tidegate's finish reasons in OpenAI's vocabulary.

``ChatShape`` and ``CompletionShape`` answer the same questions for their endpoint, so the code
that follows a job's events (``tidegate.producer.openai_compat.answer``) is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tokenizers import decoders

from tidegate.model_files.byte_level_bpe import bytes_to_unicode
from tidegate.model_files.tokenizer import Tokenizer
from tidegate.structured.tool_calls import ToolFormat

# tidegate's finish reason -> OpenAI's (stop | length | content_filter). A deadline cuts the
# text short as max_tokens does, so it reads as "length"; a cancel is a stop the caller asked
# for. "error" has no OpenAI equivalent: it is answered as an error.
FINISH_REASONS = {"stop": "stop", "length": "length", "deadline": "length", "cancelled": "stop"}


@dataclass(frozen=True, slots=True)
class Alternative:
    token: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's logprob and the most likely alternatives at its step."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[Alternative]
    offset: int  # characters of the completion's text before this token's text


class TokenSpeller:
    """Each token id's text and UTF-8 bytes, as OpenAI's logprobs show them.

    A byte-level token may hold part of a character: its ``bytes`` are exact, its text has a
    replacement character where the partial character is.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._unspell = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            piece = self._tokenizer.backend.id_to_token(token_id) or ""
            if self._byte_level and piece and all(c in self._unspell for c in piece):
                self._cache[token_id] = bytes(self._unspell[c] for c in piece)
            else:  # not byte-level (e.g. SentencePiece); a special token decodes to ""
                self._cache[token_id] = (self._tokenizer.decode([token_id]) or piece).encode()
        return self._cache[token_id]

    def logprob(self, event: dict[str, Any], offset: int) -> TokenLogprob:
        """A ``token`` event's logprobs (the event must carry them)."""
        raw = b"".join(self.bytes_of(i) for i in event["token_ids"])
        top = [Alternative(self._text(b := self.bytes_of(alt["token_id"])), list(b), alt["logprob"])
               for alt in event.get("top_logprobs") or []]
        return TokenLogprob(self._text(raw), list(raw), float(event.get("logprob") or 0.0), top,
                            offset)

    @staticmethod
    def _text(raw: bytes) -> str:
        return raw.decode("utf-8", errors="replace")


@dataclass
class _Shape:
    id: str
    model: str
    created: int  # unix seconds
    logprobs: bool  # whether the request asked for logprobs
    include_usage: bool = False  # streams: every chunk has "usage" (null until the last)
    # Chat with tools: how the model writes calls (a stream holds text that may be one).
    tool_format: ToolFormat | None = None
    echo: str = ""  # completions with echo: the prompt, before the completion's text
    n: int = 1  # choices
    chunk_object: ClassVar[str] = ""

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created,
                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage}


@dataclass(frozen=True, slots=True)
class ChoiceAnswer:
    """One choice's final answer: its text, logprobs, finish reason and tool calls."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    reason: str
    tool_calls: list[dict[str, Any]] | None = None


class ChatShape(_Shape):
    """``/v1/chat/completions``: ``chat.completion`` bodies, ``chat.completion.chunk`` deltas."""

    chunk_object = "chat.completion.chunk"

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        return self._choice_chunk(index, {"role": "assistant", "content": ""}, [], None)

    def text_chunk(self, text: str, logprobs: list[TokenLogprob],
                   index: int = 0) -> dict[str, Any]:
        return self._choice_chunk(index, {"content": text}, logprobs, None)

    def finish_chunk(self, reason: str, logprobs: list[TokenLogprob],
                     index: int = 0) -> dict[str, Any]:
        return self._choice_chunk(index, {}, logprobs, reason)

    def tool_calls_chunk(self, calls: list[dict[str, Any]], logprobs: list[TokenLogprob],
                         index: int = 0) -> dict[str, Any]:
        """Every call whole in one delta (its id, name and arguments), as OpenAI's clients
        accumulate them by ``index``."""
        deltas = [{"index": i, "id": c["id"], "type": "function",
                   "function": {"name": c["function"]["name"],
                                "arguments": c["function"]["arguments"]}}
                  for i, c in enumerate(calls)]
        return self._choice_chunk(index, {"tool_calls": deltas}, logprobs, None)

    def body(self, choices: list[ChoiceAnswer], usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [self._choice_body(c) for c in choices],
                "usage": usage}

    def _choice_body(self, c: ChoiceAnswer) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        reason = c.reason
        if c.tool_calls:
            rest = self.tool_format.parse(c.text)[0].strip() if self.tool_format else ""
            message.update(content=rest or None, tool_calls=c.tool_calls)
            reason = "tool_calls"
        return {"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                "finish_reason": reason}

    def _choice_chunk(self, index: int, delta: dict[str, Any], logprobs: list[TokenLogprob],
                      reason: str | None) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": delta,
                             "logprobs": self._logprobs(logprobs), "finish_reason": reason}])

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = [{"token": t.token, "bytes": t.bytes, "logprob": t.logprob,
                    "top_logprobs": [{"token": a.token, "bytes": a.bytes, "logprob": a.logprob}
                                     for a in t.top]} for t in logprobs]
        return {"content": content, "refusal": None}


class CompletionShape(_Shape):
    """``/v1/completions``: ``text_completion`` bodies and chunks."""

    chunk_object = "text_completion"

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        # Completions have no role to announce; an echoed prompt comes first.
        return self._chunk([self._choice(index, self.echo, [], None)]) if self.echo else None

    def text_chunk(self, text: str, logprobs: list[TokenLogprob],
                   index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice(index, text, logprobs, None)])

    def finish_chunk(self, reason: str, logprobs: list[TokenLogprob],
                     index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice(index, "", logprobs, reason)])

    def body(self, choices: list[ChoiceAnswer], usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [self._choice(c.index, self.echo + c.text, c.logprobs, c.reason)
                            for c in choices],
                "usage": usage}

    def _choice(self, index: int, text: str, logprobs: list[TokenLogprob],
                reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(logprobs),
                "finish_reason": reason}

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"tokens": [t.token for t in logprobs],
                "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{a.token: a.logprob for a in t.top} for t in logprobs],
                "text_offset": [t.offset for t in logprobs]}


Shape = ChatShape | CompletionShape
