"""Every benchmark runs as a module of the installed package (``python -m
tidegate.benchmarks.<room>.<name> --help``, from outside the checkout, with ``PYTHONSAFEPATH=1``),
and none finds its imports by editing ``sys.path`` or ``PYTHONPATH``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# The harness's own entry points are tools the benchmarks start, not benchmarks (no --help).
NOT_BENCHMARKS = ("harness",)
# Modules that cannot be imported without CUDA, with the reason (none today).
NEEDS_CUDA: dict[str, str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(BENCHMARKS).with_suffix("").parts
    return ".".join(("tidegate", "benchmarks", *parts))


def benchmark_modules() -> list[str]:
    return sorted(module_name(p) for p in BENCHMARKS.rglob("*.py")
                  if p.relative_to(BENCHMARKS).parts[0] not in NOT_BENCHMARKS
                  and '__name__ == "__main__"' in p.read_text())


def help_of(module: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", module, "--help"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every benchmark's ``--help``, run four at a time (each imports its dependencies)."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    runnable = [m for m in benchmark_modules() if m not in NEEDS_CUDA]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(runnable, pool.map(lambda m: help_of(m, cwd), runnable), strict=True))


def test_the_walk_finds_the_benchmarks_of_every_room() -> None:
    found = benchmark_modules()
    assert "tidegate.benchmarks.serving.serve" in found
    assert {m.split(".")[2] for m in found} >= {"serving", "engine", "kernels", "cluster"}


@pytest.mark.parametrize("module", benchmark_modules())
def test_benchmark_answers_help_as_a_module(
        module: str, helps: dict[str, subprocess.CompletedProcess[str]]) -> None:
    if module in NEEDS_CUDA:
        pytest.skip(f"{module} needs CUDA to import: {NEEDS_CUDA[module]}")
    done = helps[module]
    assert done.returncode == 0, f"{module} --help exited {done.returncode}:\n{done.stderr[-2000:]}"
    assert "usage:" in done.stdout


# PYTHONPATH pointed at the checkout (``$PWD``, ``$(pwd)``, ``.``): what the package replaced.
# The device sessions' ``PYTHONPATH=/tmp/site`` (the checkout installed there) is no such edit.
CHECKOUT_ON_PYTHONPATH = re.compile(r"PYTHONPATH=\S*(\$PWD|\$\{PWD\}|\$\(pwd\)|(^|[=:])\.(:|\s|$))")


def test_no_benchmark_edits_the_import_path() -> None:
    offenders = []
    for path in sorted(BENCHMARKS.rglob("*")):
        if not path.is_file() or path.suffix not in (".py", ".sh", ".md"):
            continue
        text = path.read_text()
        in_python = path.suffix == ".py" and ("sys.path" in text or "PYTHONPATH" in text)
        if in_python or CHECKOUT_ON_PYTHONPATH.search(text):
            offenders.append(str(path.relative_to(BENCHMARKS)))
    assert offenders == []
