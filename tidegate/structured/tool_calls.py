"""Tool calls in a model's own format: which format a chat template uses, the grammar that
forces a call, and the calls read back out of the text.

Two formats cover the open models tidegate serves: Hermes (Qwen2/2.5/3, Hermes, and the ChatML
template tidegate falls back to), where each call is ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, and Llama 3.1+ (a call is the whole reply, ``{"name": ...,
"parameters": {...}}``). The format is read off the chat template's text; a template that
never renders ``tools`` has none, and a request with tools is refused for it.

``tool_choice: "auto"`` leaves the reply free and parses calls out of it; ``"required"`` and a
named function are enforced by a grammar (the arguments by each function's parameter schema).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tidegate.structured.grammar import JSON_OPTIONS

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, compact, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one family of chat templates writes tool calls."""

    name: str  # "hermes" | "llama3"
    arguments_key: str  # the call object's key holding the arguments

    def grammar(self, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose sentences are calls of ``tools``
        (dicts: {"name", "parameters"}), or of ``only`` when named; several calls when
        ``parallel`` and the format allows it."""
        chosen = [t for t in tools if only is None or t["name"] == only]
        schema = {"anyOf": [_call_schema(t, self.arguments_key) for t in chosen],
                  "x-guidance": JSON_OPTIONS}
        body = f"body: %json {json.dumps(schema, ensure_ascii=False)}"
        if self.name == "hermes":
            many = ' ("\\n" call)*' if parallel else ""
            return (f"start: call{many}\n"
                    f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n{body}\n')
        return f"start: body\n{body}\n"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text that is not a call, the calls) of a complete reply."""
        if self.name == "hermes":
            calls = [c for m in _HERMES_CALL.finditer(text) if (c := self._call(m.group(1)))]
            if not calls:
                return text, []
            rest = _HERMES_CALL.sub("", text).strip()
            return rest, calls
        stripped = text.strip()
        call = self._call(stripped) if stripped.startswith("{") else None
        return ("", [call]) if call else (text, [])

    def call_start(self, text: str) -> int | None:
        """Where a call may begin in a reply streamed so far (text before it can be sent as
        content; from there on it is held until the reply ends); None: nowhere yet."""
        if self.name == "hermes":
            at = text.find(HERMES_OPEN)
            if at >= 0:
                return at
            for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
                if HERMES_OPEN.startswith(text[-keep:]):
                    return len(text) - keep  # a marker may be arriving
            return None
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None  # only blanks so far: a call may follow
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def _call(self, raw: str) -> ParsedCall | None:
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", {}))
        if isinstance(arguments, str):  # some models write the object as a string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


HERMES = ToolFormat("hermes", "arguments")
LLAMA3 = ToolFormat("llama3", "parameters")


def forced_call_grammar(fmt: ToolFormat, tools: list[Any], choice: Any, parallel: bool) -> str:
    """The grammar of a job whose ``tool_choice`` forces a call (``protocol.Tool`` objects;
    ``choice``: "required" or a named choice)."""
    specs = [{"name": t.function.name, "parameters": t.function.parameters} for t in tools]
    only = None if isinstance(choice, str) else choice.function.name
    return fmt.grammar(specs, only, parallel=parallel and only is None)


def tool_format_of(template: str) -> ToolFormat | None:
    """The tool-call format a chat template's text uses; None when it renders no tools."""
    if "tools" not in template:
        return None
    if HERMES_OPEN in template:
        return HERMES
    if '"parameters"' in template or "ipython" in template:
        return LLAMA3
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}
