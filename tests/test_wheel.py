"""The wheel as a user gets it (issue 39): built from the repository without the network, one
top-level package with its data inside, installed in a fresh virtualenv outside the repository,
where it imports beside Hugging Face's ``kernels`` and serves a job with ``tidegate up``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.stack_process import children, is_alive, stop, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEST_SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()
# The repository's folders and where they install (setup.py).
PACKAGE_DIRS = {"tidegate": "tidegate", "producer": "tidegate/producer",
                "worker": "tidegate/worker", "kernels": "tidegate/kernels",
                "streaming": "tidegate/streaming", "benchmarks": "tidegate/benchmarks"}
# The folders of files read at run time beside the code (pyproject.toml's package-data).
DATA_DIRS = ("kernels/cpu/csrc", "streaming/static")
# pip offline: no index, no version check against PyPI, nothing left in the user's cache.
PIP_ENV = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1",
           "PIP_NO_INPUT": "1"}


@dataclass(frozen=True)
class FreshVenv:
    """A virtualenv outside the repository holding the wheel; the test environment's
    site-packages is on its path through a plain ``.pth`` line (no editable finder runs)."""

    root: Path
    site_packages: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def tidegate(self) -> Path:
        return self.root / "bin" / "tidegate"


def run(*args: object, cwd: Path, env: dict[str, str] | None = None,
        timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel`` of the repository, offline; setuptools' build and egg-info folders go to
    the temporary directory (DIST_EXTRA_CONFIG), so stale files of the repository's ``build/``
    cannot slip into the wheel and the repository is not written."""
    tmp = tmp_path_factory.mktemp("wheel")
    config = tmp / "setup.cfg"
    config.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp}\n")
    env = {**os.environ, **PIP_ENV, "DIST_EXTRA_CONFIG": str(config)}
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-w", tmp / "dist", ROOT, cwd=tmp, env=env)
    [built] = (tmp / "dist").glob("tidegate-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> FreshVenv:
    """The wheel is installed before the ``.pth`` line exists, so pip sees an empty venv (the
    test environment's editable tidegate is installed too, with the same version)."""
    tmp = tmp_path_factory.mktemp("venv")
    root = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", root, cwd=tmp)
    python = root / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                  cwd=tmp).stdout.strip()
    # pip runs the new interpreter with only pip itself on its path (`--python`).
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        wheel, cwd=tmp, env={**os.environ, **PIP_ENV})
    site_packages = Path(purelib)
    (site_packages / "test_environment.pth").write_text(f"{TEST_SITE_PACKAGES}\n")
    return FreshVenv(root, site_packages)


def venv_env(**extra: str) -> dict[str, str]:
    """The environment of the fresh venv's processes: no PYTHONPATH, no unsafe path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONSAFEPATH": "1", **extra}


def wheel_name(folder: Path) -> str:
    """Where a folder of the repository lies in the wheel."""
    top, *rest = folder.relative_to(ROOT).parts
    return "/".join([PACKAGE_DIRS[top], *rest])


def code_folders() -> set[str]:
    """The wheel's names of the repository's folders that hold Python modules."""
    return {wheel_name(path.parent) for top in PACKAGE_DIRS for path in (ROOT / top).rglob("*.py")
            if "__pycache__" not in path.parts}


def data_files() -> set[str]:
    """The wheel's names of the files read at run time beside the code."""
    return {wheel_name(path) for folder in DATA_DIRS for path in (ROOT / folder).iterdir()
            if path.is_file()}


def test_wheel_holds_one_top_level_package_with_its_code_and_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    [dist_info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert zipfile.Path(wheel, f"{dist_info}/top_level.txt").read_text().split() == ["tidegate"]
    assert {n for n in names if not n.startswith(("tidegate/", f"{dist_info}/"))} == set()
    # A folder of modules without __init__.py would be left out (find_packages).
    assert code_folders() - {name.rsplit("/", 1)[0] for name in names} == set()
    assert data_files() and data_files() - names == set()


def test_fresh_venv_imports_the_wheel_beside_hugging_face_kernels(venv: FreshVenv,
                                                                   tmp_path: Path) -> None:
    probe = ("import json, kernels, transformers, tidegate, tidegate.kernels\n"
             "from transformers.utils import is_kernels_available\n"
             "print(json.dumps({'kernels': kernels.__file__, "
             "'transformers': transformers.__file__, 'tidegate': tidegate.__file__, "
             "'tidegate.kernels': tidegate.kernels.__file__, "
             "'available': is_kernels_available()}))")
    found = json.loads(run(venv.python, "-c", probe, cwd=tmp_path, env=venv_env()).stdout)
    assert found.pop("available") is True
    where = {name: Path(path).resolve() for name, path in found.items()}
    assert where["kernels"] == TEST_SITE_PACKAGES / "kernels" / "__init__.py"
    assert where["transformers"].is_relative_to(TEST_SITE_PACKAGES)
    assert where["tidegate"] == venv.site_packages.resolve() / "tidegate" / "__init__.py"
    assert where["tidegate.kernels"] == where["tidegate"].parent / "kernels" / "__init__.py"
    assert not where["tidegate"].is_relative_to(ROOT)


@contextmanager
def tidegate_up(venv: FreshVenv, redis_url: str, cwd: Path, env: dict[str, str]
                ) -> Iterator[tuple[str, subprocess.Popen]]:
    """The venv's ``tidegate up`` on ``random:tiny``: its base URL once the banner says a
    worker heartbeats; on exit SIGTERM, and no process of it outlives it."""
    port = free_port()
    proc = subprocess.Popen([venv.tidegate, "up", "--redis-url", redis_url, "--port", str(port),
                             "--model", "random:tiny"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "tidegate is up" in line:
            break
    else:
        pytest.fail(f"tidegate up exited ({proc.wait()}) before it was up:\n{''.join(lines)}")
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    spawned = children(proc.pid)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)
        wait_until(lambda: not any(is_alive(pid) for pid in spawned),
                   f"the processes {spawned} of tidegate up to leave", timeout_s=30)
    assert proc.returncode == 0, "".join(lines)


def test_tidegate_up_from_the_wheel_serves_a_job(venv: FreshVenv, redis_url: str,
                                                 tmp_path: Path) -> None:
    # Native kernels must build (TIDEGATE_KERNELS=native) from the wheel's C sources into a
    # cache of their own, not into the installed package.
    kernel_cache = tmp_path / "kernel-cache"
    env = venv_env(TIDEGATE_KERNELS="native", TIDEGATE_KERNEL_CACHE=str(kernel_cache),
                   TIDEGATE_METRICS_PORT="0", TIDEGATE_LOG_LEVEL="WARNING")
    installed = {p for p in (venv.site_packages / "tidegate").rglob("*") if p.is_file()}
    with tidegate_up(venv, redis_url, tmp_path, env) as (url, proc):
        for pid in children(proc.pid):  # the worker runs the venv's interpreter too
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            assert Path(argv0) == venv.python, argv0
        out = run(venv.tidegate, "submit", "--url", url, "--max-tokens", "8", "--seed", "1",
                  "--json", "Say hello.", cwd=tmp_path, env=env)
    result = json.loads(out.stdout)
    assert result["status"] == "done" and result["error"] is None
    assert result["usage"]["completion_tokens"] == 8 and result["finish_reason"] == "length"
    assert list(kernel_cache.glob("tidegate-cpu-*.so"))
    written = {p for p in (venv.site_packages / "tidegate").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts} - installed
    assert written == set()
