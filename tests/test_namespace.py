"""One import namespace: our kernels are ``tidegate.kernels``, so Hugging Face's ``kernels``
package (which transformers imports) and ours load side by side in one process, and the
roles' folders are no top-level modules of their own (issue 39).
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()


def test_hugging_face_kernels_and_ours_import_in_one_process() -> None:
    import kernels
    import transformers
    import transformers.integrations.hub_kernels  # the module that imports `kernels`
    from transformers.utils import is_kernels_available

    import tidegate.kernels

    hf_kernels = Path(kernels.__file__).resolve()
    assert hf_kernels.is_relative_to(SITE_PACKAGES), hf_kernels
    assert hf_kernels.parent != ROOT / "kernels"
    assert sys.modules["kernels"] is kernels and is_kernels_available()
    assert Path(tidegate.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(transformers.__file__).resolve().is_relative_to(SITE_PACKAGES)


def test_transformers_is_the_one_that_imports_hugging_face_kernels() -> None:
    import transformers

    assert Version(transformers.__version__) >= Version("5.25")


def test_the_repository_root_comes_after_every_installed_package() -> None:
    """What keeps the root's folders from hiding installed packages in the test process: pytest's
    ``--import-mode=append`` puts the root last (for ``tests.*``), and ``python -P`` keeps the
    working directory off the front. ``python -m pytest`` without ``-P`` fails here."""
    entries = [Path(p or ".").resolve() for p in sys.path]
    installed = [i for i, p in enumerate(entries) if p.name in ("site-packages", "dist-packages")]
    assert installed and ROOT in entries
    assert entries.index(ROOT) > max(installed), sys.path


@pytest.mark.parametrize("name", ["producer", "worker", "streaming", "benchmarks"])
def test_a_role_folder_is_no_top_level_module(name: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the repository root itself, which pytest's ``--import-mode=append`` puts at the end
    of sys.path for ``tests.*``, would make the folder importable: without that entry (as every
    process the suite or a user starts runs, with ``-P``), nothing names it."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    spec = importlib.util.find_spec(name)
    if spec is not None:
        places = [spec.origin or "", *(spec.submodule_search_locations or [])]
        folder = ROOT / name
        assert not any(Path(p).resolve().is_relative_to(folder) for p in places if p), spec
