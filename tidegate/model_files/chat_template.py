"""A model's chat template: Jinja rendered in a sandbox the way ``transformers`` renders it.

The environment copies ``apply_chat_template``'s (trim_blocks, lstrip_blocks, loop controls, a
``tojson`` that does not HTML-escape, ``raise_exception``, ``strftime_now``) so that templates
written for Hugging Face render to the same text here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: plain ChatML, which SmolLM2 and many others were tuned on.
# With tools it writes them into the system turn and takes calls in the Hermes format (the one
# most ChatML models were tuned on), so models without a template of their own can call tools.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ 'You may call functions. Their signatures, as JSON schemas, are inside <tools></tools>:"
    "\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}"
    "{{ '</tools>\nTo call one, answer with a JSON object {\"name\": function name, "
    "\"arguments\": arguments object} between <tool_call> and </tool_call>, one call per "
    "pair.<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that end an assistant turn in common templates; a model stops at whichever its template
# uses, even when its metadata names only the end-of-text token as eos.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate) or is broken."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may read."""

    def __init__(self, source: str, variables: Mapping[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._variables = {k: v for k, v in variables.items() if v is not None}

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The conversation as the model's prompt text, ending with the assistant's turn opener.
        ``tools``: OpenAI's tool objects, which templates that know tools render."""
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self._variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc

    def turn_end_tokens(self) -> list[str]:
        """Which of the common turn-ending tokens this template writes."""
        return [token for token in TURN_END_TOKENS if token in self.source]
