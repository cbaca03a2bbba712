"""What a result was made by: the command (as one would type it again), the machine and the
git commit; every benchmark's result JSON carries these."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command(argv: list[str] | None = None, module: str | None = None) -> str:
    """``python -m tidegate.benchmarks.<room>.<name> ARGS``: the module run (``module``, for a
    ``main(argv)`` that may be called from elsewhere, e.g. a test), else the script's path;
    ``argv``: the arguments ``main`` was given (default ``sys.argv[1:]``)."""
    args = sys.argv[1:] if argv is None else argv
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module is None and spec is not None and spec.name.startswith("tidegate"):
        module = spec.name
    head = ["python", "-m", module] if module else ["python", sys.argv[0]]
    return shlex.join([*head, *args])


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (``avx2``, ``avx512f``, ...); empty where
    there is none to read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def memory_gb() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def usable_cpus() -> int:
    """The cores this process may run on (a cgroup or taskset may allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def gpu_name() -> str | None:
    """The first CUDA device's name: from torch if the benchmark has imported it already (a CPU
    benchmark pays no torch import for its record), else from ``nvidia-smi`` where there is
    one (a stack's parent process, whose workers hold the GPU)."""
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name()
    if torch is None and shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            names = out.stdout.splitlines() if out.returncode == 0 else []
            if names:
                return names[0].strip()
    return None


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, object]:
    # a CPU figure depends on which vector instructions the kernels were built for
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in cpu_flags()]
    return {"cpu_model": cpu_model(), "cpu_simd": simd, "cpus": usable_cpus(), "cpu_count": os.cpu_count(),
            "memory_gb": memory_gb(), "platform": platform.platform(),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": package_version("torch"), "gpu": gpu_name()}


def git_commit() -> str | None:
    """HEAD of the checkout the benchmark runs from, with ``+dirty`` when its tracked files
    differ from HEAD (a copied tree whose ``.git`` is older than its files); None outside a git
    checkout, as in a copy of the tree without ``.git``."""
    for where in (ROOT, Path.cwd()):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=10)
            if done.returncode == 0:
                clean = subprocess.run(["git", "-C", str(where), "diff", "--quiet", "HEAD"],
                                       capture_output=True, timeout=30).returncode == 0
                return done.stdout.strip() + ("" if clean else "+dirty")
    return None


def record(argv: list[str] | None = None, module: str | None = None) -> dict[str, object]:
    """``command``, ``machine``, ``git_commit`` and ``date`` of a result, to merge into it."""
    return {"command": command(argv, module), "machine": machine(), "git_commit": git_commit(),
            "date": time.strftime("%Y-%m-%d")}
