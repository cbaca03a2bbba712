"""A worker's seats and step budget: the device's defaults where they are unset, what the
environment or the command line sets otherwise (the engine side: tests/worker/service/
test_engine_config.py)."""

from __future__ import annotations

import argparse

import pytest

from tidegate.commands.cli import CliError, _add_engine, _settings
from tidegate.settings import CPU_BATCH, CUDA_BATCH, BatchLimits, batch_limits, load_settings


def test_unset_limits_follow_the_device() -> None:
    assert load_settings().max_num_seqs is None
    assert load_settings().batch() == CPU_BATCH == BatchLimits(32, 512)
    assert load_settings(device="cuda").batch() == CUDA_BATCH == BatchLimits(1024, 8192)
    assert load_settings(device="cuda:1").batch() == CUDA_BATCH


def test_what_is_set_wins_and_the_budget_covers_every_seat() -> None:
    assert batch_limits("cuda", 256) == BatchLimits(256, 8192)
    assert batch_limits("cuda", None, 16384) == BatchLimits(1024, 16384)
    assert batch_limits("cpu", 64, 2048) == BatchLimits(64, 2048)
    # Every running request decodes in a step: the budget is raised to the seats.
    assert batch_limits("cpu", 64) == BatchLimits(64, 512)
    assert batch_limits("cpu", 1000) == BatchLimits(1000, 1000)
    assert batch_limits("cuda", 10_000) == BatchLimits(10_000, 10_000)


def test_the_environment_and_the_flags_set_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_DEVICE", "cuda")
    monkeypatch.setenv("TIDEGATE_MAX_NUM_SEQS", "128")
    parser = argparse.ArgumentParser()
    _add_engine(parser)
    assert _settings(parser.parse_args([])).batch() == BatchLimits(128, 8192)
    flags = ["--max-num-seqs", "64", "--max-num-batched-tokens", "4096"]
    assert _settings(parser.parse_args(flags)).batch() == BatchLimits(64, 4096)
    with pytest.raises(CliError, match="max_num_seqs"):
        _settings(parser.parse_args(["--max-num-seqs", "0"]))
