"""``reference/cli.md``: every command, subcommand, argument and flag, from the parser itself.

The page walks ``tidegate.commands.cli.build_parser()``: each command's help, its usage line
and a table of its arguments. A flag that sets a setting shows the setting's environment
variable and default (from ``Settings``), since the flag's own default is "not given".
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

from tidegate.commands.cli import OWN_OPTIONS, SETTING_FLAGS, build_parser
from tidegate.commands.reference.markdown import code, page_head, sentence, table
from tidegate.settings import Settings

PAGE = "reference/cli.md"


@dataclass(frozen=True, slots=True)
class Command:
    path: tuple[str, ...]  # ("batch", "submit")
    help: str
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        return " ".join(("tidegate", *self.path))

    def setting(self, action: argparse.Action) -> str | None:
        """The setting a flag of this command sets, if any."""
        if not action.option_strings or self.path[0] in OWN_OPTIONS:
            return None
        return SETTING_FLAGS.get(action.dest)


def commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """Every leaf command, in the parser's order."""
    return list(_walk(parser or build_parser(), ()))


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[Command]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                subpath = (*path, name)
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _walk(sub, subpath)
                else:
                    yield Command(subpath, helps.get(name, ""), sub)


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar if isinstance(action.metavar, str) else action.dest
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    metavar = action.metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"{flags} {metavar}"


def _default(command: Command, action: argparse.Action) -> str:
    setting = command.setting(action)
    if setting is not None and action.default is None:
        env = "TIDEGATE_" + setting.upper()
        default = Settings.model_fields[setting].get_default(call_default_factory=True)
        shown = "unset" if default in (None, []) else code(_plain(default))
        return f"{shown} ([{code(env)}](settings.md#{env.lower()}))"
    if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    return code(action.default)


def _plain(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _description(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    # argparse's own expansion: %(default)s and the like, %% as %.
    words = [sentence(parser._get_formatter()._expand_help(action))] if action.help else []
    if action.choices is not None:
        words.append(f"One of: {', '.join(map(str, action.choices))}.")
    if action.required and action.option_strings:
        words.append("Required.")
    if isinstance(action, argparse._AppendAction) and "repeatable" not in (action.help or ""):
        words.append("Repeatable.")
    return " ".join(words)


def page() -> str:
    parser = build_parser()
    out = page_head("CLI", "the command's parser (`tidegate/commands/cli.py`)",
                    "Every command takes `--help`. Bad input exits with code 2 and one line "
                    "naming the argument; settings not given as flags come from the "
                    "environment ([Settings and environment](settings.md)).")
    out += ["| command | what it does |", "|---|---|"]
    out += [f"| [{code(c.name)}](#{c.name.replace(' ', '-')}) | {sentence(c.help)} |"
            for c in commands(parser)]
    out.append("")
    for command in commands(parser):
        usage = command.parser.format_usage().strip().removeprefix("usage: ").splitlines()
        usage[1:] = [line.removeprefix(" " * len("usage: ")) for line in usage[1:]]
        out += [f"## {command.name}", "", sentence(command.help), "", "```text", *usage,
                "```", ""]
        rows = [(code(_name(a)), _default(command, a), _description(command.parser, a)) for a in _arguments(command.parser)]
        if rows:
            out.append(table(("argument", "default", "description"), rows))
    return "\n".join(out)


def gaps(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Commands and arguments without a help text."""
    missing = []
    for command in commands(parser):
        if not command.help.strip():
            missing.append(f"CLI command {command.name!r} has no help")
        for action in _arguments(command.parser):
            if not (action.help or "").strip():
                missing.append(f"CLI argument {_name(action)!r} of {command.name!r} has no help")
    return missing
