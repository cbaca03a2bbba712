"""Every benchmark runs as a module of the installed package (``python -m
tidegate.benchmarks.<room>.<name> --help``, from outside the checkout, with ``PYTHONSAFEPATH=1``),
and none finds its imports by editing ``sys.path`` or ``PYTHONPATH``. Each one runs in a process
of its own, forked from one that has imported torch (what ``python -m`` would do after it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


# Runs in one interpreter that imports torch once (~1.2 s of CPU, which 14 of the benchmarks
# would each pay again), then forks a child per benchmark: the child runs it as ``python -m``
# does (``runpy``, as ``__main__``, argv = [module, "--help"]), with its output on its own
# files, and nothing any other benchmark imported. Prints {module: [exit code, stdout, stderr]}.
FORKED_HELPS = """
import json, os, runpy, sys, tempfile, traceback
import torch  # noqa: F401 - imported once, before the forks
results = {}
for module in sys.argv[1:]:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = [module, "--help"]
            code = 0
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        results[module] = [os.waitstatus_to_exitcode(status), out.read(), err.read()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every benchmark's ``--help``, from outside the checkout with ``PYTHONSAFEPATH=1``."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    runnable = [m for m in benchmark_modules() if m not in NEEDS_CUDA]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", FORKED_HELPS, *runnable], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {m: subprocess.CompletedProcess([m, "--help"], code, out, err)
            for m, (code, out, err) in json.loads(done.stdout).items()}


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
