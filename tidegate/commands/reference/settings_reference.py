"""``reference/settings.md``: every setting, and every other environment variable the code reads.

Settings come from ``tidegate.settings.Settings``: each field's variable (``TIDEGATE_`` and its
name), type, default, bounds, description, and the commands whose flags set it. Variables
outside the settings model (the client's, Hugging Face's, the kernels') are listed in
``OTHER_ENVIRONMENT``; ``undocumented_variables`` finds any ``TIDEGATE_*`` name in the source
that is in neither, so a new variable cannot ship without its line.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from tidegate.commands.reference.cli_reference import commands
from tidegate.commands.reference.markdown import code, page_head, sentence, table
from tidegate.settings import Settings

PAGE = "reference/settings.md"
ENV_PREFIX = "TIDEGATE_"

# name -> what it does. Read by the code, outside the settings model.
OTHER_ENVIRONMENT: dict[str, str] = {
    "REDIS_URL": "the Redis URL when TIDEGATE_REDIS_URL is unset (the common convention)",
    "TIDEGATE_URL": "`tidegate submit`: the API's base URL (default http://127.0.0.1:8000)",
    "TIDEGATE_API_KEY": "`tidegate submit`: the API key it sends (never a flag: argv is "
                        "visible to every user of the machine)",
    "TIDEGATE_KERNELS": "which kernels run: auto (default: Triton on CUDA; on the CPU the "
                        "native C kernels where they apply and build, else the plain-torch "
                        "reference), reference, native (the native kernels must build), triton",
    "TIDEGATE_KERNEL_CACHE": "where the CPU's native kernels are compiled to (default "
                             "XDG_CACHE_HOME/tidegate/kernels)",
    "HF_TOKEN": "a Hugging Face token for gated or private Hub models (registered with the "
                "log redactor: never logged)",
    "HUGGING_FACE_HUB_TOKEN": "the token's older name, read when HF_TOKEN is unset",
    "HF_HOME": "the Hugging Face home; the model cache is HF_HOME/hub",
    "HF_HUB_CACHE": "the Hugging Face model cache itself (HUGGINGFACE_HUB_CACHE: its older "
                    "name)",
    "HF_HUB_OFFLINE": "1: never contact the Hub, serve models from the cache alone",
    "HF_ENDPOINT": "the Hub's address (a mirror, or a test's emulator)",
    "XDG_CACHE_HOME": "the user's cache directory (default ~/.cache): the Hugging Face cache "
                      "and compiled kernels go under it",
    "CC": "the C compiler that builds the CPU's native kernels (default cc)",
    "TRITON_INTERPRET": "1: run the Triton kernels in Triton's interpreter on the CPU (tests)",
}
# Not environment variables, though quoted like one: the settings' prefix itself.
NOT_VARIABLES = frozenset({"TIDEGATE_"})
_NAME = re.compile(r"""["'](TIDEGATE_[A-Z0-9_]*)["']""")


def variable(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _type(info: FieldInfo) -> str:
    kind = info.annotation
    if typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    args = typing.get_args(kind)
    optional = type(None) in args
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in args if a is not type(None))
    name = "list of strings" if typing.get_origin(kind) is list else getattr(kind, "__name__",
                                                                              str(kind))
    return f"{name}, optional" if optional else name


def _bounds(info: FieldInfo) -> str:
    words = []
    for item in info.metadata:
        for attr, word in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None and isinstance(item, annotated_types.BaseMetadata):
                words.append(f"{word} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            words.append(f"matches {code(pattern)}")
    return ", ".join(words)


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if value is None or value == []:
        return "unset"
    return code(str(value).lower() if isinstance(value, bool) else value)


def _flags() -> dict[str, list[str]]:
    """Setting -> the flags that set it, with their commands."""
    found: dict[str, dict[str, list[str]]] = {}
    for command in commands():
        for action in command.parser._actions:
            setting = command.setting(action)
            if setting is not None:
                by_flag = found.setdefault(setting, {})
                by_flag.setdefault(action.option_strings[-1], []).append(" ".join(command.path))
    return {dest: [f"{code(flag)} ({', '.join(cmds)})" for flag, cmds in flags.items()]
            for dest, flags in found.items()}


def page() -> str:
    flags = _flags()
    out = page_head("Settings and environment", "the settings model (`tidegate/settings.py`)",
                    "Every process reads its settings from `TIDEGATE_*` environment variables; "
                    "a command-line flag, where one exists, overrides its variable. Booleans "
                    "take `true`/`false` (also `1`/`0`); list settings take a comma list or a "
                    "JSON list. A bad value stops the process at start with one line naming "
                    "the setting and the reason (exit code 2).")
    for name, info in Settings.model_fields.items():
        facts = [f"type {code(_type(info))}", f"default {_default(info)}"]
        if bounds := _bounds(info):
            facts.append(bounds)
        out += [f"### {variable(name)}", "", sentence(info.description or ""), "",
                "; ".join(facts) + ".", ""]
        if name in flags:
            out += ["Flag: " + ", ".join(flags[name]) + ".", ""]
    out += ["## Other environment variables", "",
            "Read by the code outside the settings model.", ""]
    out.append(table(("variable", "meaning"),
                     [(code(name), sentence(text)) for name, text in OTHER_ENVIRONMENT.items()]))
    return "\n".join(out)


def undocumented_variables(roots: list[Path]) -> set[str]:
    """``TIDEGATE_*`` names quoted in the source under ``roots`` that neither the settings
    model nor ``OTHER_ENVIRONMENT`` documents."""
    known = {variable(name) for name in Settings.model_fields} | set(OTHER_ENVIRONMENT)
    seen: set[str] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            seen.update(_NAME.findall(path.read_text(encoding="utf-8")))
    return seen - known - NOT_VARIABLES


def gaps(roots: list[Path] | None = None, model: type[BaseSettings] = Settings) -> list[str]:
    missing = [f"setting {name!r} ({variable(name)}) has no description"
               for name, info in model.model_fields.items()
               if not (info.description or "").strip()]
    missing += [f"environment variable {name} is read by the code but not documented"
                for name in sorted(undocumented_variables(roots or []))]
    missing += [f"environment variable {name} has no description"
                for name, text in OTHER_ENVIRONMENT.items() if not text.strip()]
    return missing
