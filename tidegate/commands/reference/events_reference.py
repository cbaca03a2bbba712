"""``reference/events.md``: every event type of the wire protocol, from its pydantic model.

The events are the members of ``tidegate.protocol.Event``; each section gives the model's
docstring and its fields (type, whether always present, description); the models they nest
(usage, timings, choices, tool calls, logprobs) follow.
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel

from tidegate import protocol
from tidegate.commands.reference.markdown import code, page_head, sentence, table

PAGE = "reference/events.md"
COMMON = ("id", "job_id")  # fields of every event (``protocol._Event``)


def event_models() -> list[type[BaseModel]]:
    union = typing.get_args(protocol.Event)[0]
    return list(typing.get_args(union))


def _event_type(model: type[BaseModel]) -> str:
    return typing.get_args(model.model_fields["type"].annotation)[0]


def nested_models(events: list[type[BaseModel]] | None = None) -> list[type[BaseModel]]:
    """The models the events' fields hold, in order of first use, nested ones included."""
    found: list[type[BaseModel]] = []

    def visit(model: type[BaseModel]) -> None:
        for info in model.model_fields.values():
            for inner in _models_in(info.annotation):
                if inner not in found:
                    found.append(inner)
                    visit(inner)

    for model in event_models() if events is None else events:
        visit(model)
    return found


def _models_in(kind: object) -> list[type[BaseModel]]:
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return [kind]
    return [m for arg in typing.get_args(kind) for m in _models_in(arg)]


def _type(kind: object) -> str:
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v)
                            for v in typing.get_args(kind))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(kind) if a is not type(None))
    if origin is list:
        return f"list of {_type(typing.get_args(kind)[0])}"
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return f"[{kind.__name__}](#{kind.__name__.lower()})"
    return getattr(kind, "__name__", str(kind))


def _rows(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        description = info.description or ""
        if name == "type" and not description:
            description = f"always {_event_type(model)}"
        rows.append((code(name), _type(info.annotation),
                     "always" if info.is_required() or name == "type" else "optional",
                     sentence(description)))
    return rows


def page() -> str:
    header = ("field", "type", "present", "description")
    out = page_head("Events", "the protocol's event models (`tidegate/protocol.py`)",
                    "A job's events are JSON objects, one per WebSocket frame or SSE message, "
                    "each with a `type`. Every job ends with exactly one final event: `done`, "
                    "`error` or `rejected`. See [the event protocol](../concepts/events.md) "
                    "for their order and how a client resumes.")
    common = [r for r in _rows(event_models()[0]) if r[0] in map(code, COMMON)]
    out += ["## Every event", "", table(header, common)]
    out += ["| type | meaning |", "|---|---|"]
    out += [f"| [{code(_event_type(m))}](#{_event_type(m)}) | {sentence(m.__doc__ or '')} |"
            for m in event_models()]
    out.append("")
    for model in event_models():
        kind = _event_type(model)
        final = " A final event." if kind in protocol.FINAL_EVENT_TYPES else ""
        out += [f"## {kind}", "", sentence(model.__doc__ or "") + final, "",
                table(header, _rows(model, skip=COMMON))]
    out += ["## Nested objects", ""]
    for model in nested_models():
        doc = model.__doc__ if model.__doc__ and "Usage docs" not in model.__doc__ else ""
        out += [f"### {model.__name__}", ""]
        if doc:
            out += [sentence(doc), ""]
        out.append(table(header, _rows(model)))
    return "\n".join(out)


def gaps(events: list[type[BaseModel]] | None = None) -> list[str]:
    events = event_models() if events is None else events
    missing = []
    for model in events:
        if not (model.__doc__ or "").strip():
            missing.append(f"event {_event_type(model)!r} has no docstring")
    for model in [*events, *nested_models(events)]:
        for name, info in model.model_fields.items():
            if name != "type" and not (info.description or "").strip():
                missing.append(f"field {name!r} of {model.__name__} has no description")
    return missing
