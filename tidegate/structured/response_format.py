"""The ``response_format`` field: the shape a job's output must take.

One field on the native API and the OpenAI routes, OpenAI's shape extended: ``text`` (free),
``json_object`` (any JSON object), ``json_schema`` (OpenAI's ``{"name", "schema", "strict"}``),
``regex``, ``choice`` (exactly one of the given strings) and ``grammar`` (Lark or GBNF). Every
kind but ``text`` is enforced token by token by the worker's grammar engine, whatever
``strict`` says: the output can only end where the grammar accepts it (or at ``max_tokens``,
with ``finish_reason: "length"``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_GRAMMAR_CHARS = 100_000
MAX_CHOICES = 1024


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)


class TextFormat(_Format):
    type: Literal["text"] = "text"


class JsonObjectFormat(_Format):
    type: Literal["json_object"] = "json_object"


class JsonSchemaSpec(_Format):
    name: str = Field(default="response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # ``schema`` would shadow BaseModel.schema(); the wire name is still "schema".
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(default=None,
                                description="accepted; the schema is always enforced")


class JsonSchemaFormat(_Format):
    type: Literal["json_schema"] = "json_schema"
    json_schema: JsonSchemaSpec


class RegexFormat(_Format):
    type: Literal["regex"] = "regex"
    pattern: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS,
                         description="the whole output matches it (Rust regex syntax)")


class ChoiceFormat(_Format):
    type: Literal["choice"] = "choice"
    choices: list[Annotated[str, Field(min_length=1, max_length=10_000)]] = Field(
        min_length=1, max_length=MAX_CHOICES, description="the output is exactly one of these")


class GrammarFormat(_Format):
    type: Literal["grammar"] = "grammar"
    grammar: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)
    syntax: Literal["lark", "gbnf"] = Field(
        default="lark", description="'lark' (Lark EBNF, llguidance's dialect) or 'gbnf' "
        "(llama.cpp's)")


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat
    | GrammarFormat,
    Field(discriminator="type"),
]
