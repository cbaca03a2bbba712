"""``cpu_activations`` from the environment and the command line: what the worker's packed
matrices multiply on the CPU (the engine side is tests/worker/engine/test_packed_engine.py)."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from tidegate.commands.cli import CliError, _add_engine, _settings
from tidegate.settings import load_settings


def test_the_environment_and_the_flag_choose_and_the_flag_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().cpu_activations == "auto"
    monkeypatch.setenv("TIDEGATE_CPU_ACTIVATIONS", "float")
    assert load_settings().cpu_activations == "float"
    parser = argparse.ArgumentParser()
    _add_engine(parser)
    assert _settings(parser.parse_args([])).cpu_activations == "float"
    assert _settings(parser.parse_args(["--cpu-activations", "int8"])).cpu_activations == "int8"


def test_an_unknown_mode_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="cpu_activations"):
        load_settings(cpu_activations="int4")
    monkeypatch.setenv("TIDEGATE_CPU_ACTIVATIONS", "fp8")
    parser = argparse.ArgumentParser()
    _add_engine(parser)
    with pytest.raises(CliError, match="cpu_activations"):
        _settings(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-activations", "int4"])
