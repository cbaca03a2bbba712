"""The import direction and the folders, read from the source: roles import ``tidegate`` and
never each other, the worker alone imports ``kernels``, ``kernels`` imports nothing of ours,
only the composition root (``tidegate.commands``) imports the roles, no two modules import each
other round a circle, no two sibling folders import each other both ways, and every package
says what it owns.

Every import counts: at the top, inside a function (a lazy import still ties the modules) and
under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each folder of the repository's top and the name it installs under (setup.py): one namespace.
PACKAGES = {"tidegate": "tidegate", "producer": "tidegate.producer", "worker": "tidegate.worker",
            "streaming": "tidegate.streaming", "kernels": "tidegate.kernels",
            "benchmarks": "tidegate.benchmarks"}
ROLES = ("producer", "worker", "streaming")
COMPOSITION_ROOT = "tidegate.commands"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def modules(root: Path) -> dict[str, Path]:
    """Every module of our packages under ``root`` by dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            name = ".".join([package, *path.relative_to(root / folder).with_suffix("").parts])
            found[name.removesuffix(".__init__")] = path
    return found


def imports(root: Path) -> list[Import]:
    """Each import of one of our modules by another, as the interpreter resolves its name."""
    known = modules(root)
    found: list[Import] = []
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package up
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                # ``from pkg import mod`` imports the module; ``from mod import name`` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            for target in targets:
                while target and target not in known:  # ``import a.b.c`` of a name inside
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.append(Import(name, target, node.lineno))
    return found


def _top(module: str) -> str:
    """The part a module belongs to: a role, ``kernels``, ``benchmarks`` or ``tidegate`` (what
    every role shares)."""
    part = module.split(".")[1] if module.count(".") else ""
    return part if part in PACKAGES and part != "tidegate" else "tidegate"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def direction_errors(root: Path) -> list[str]:
    """Each import that points the wrong way, said as what it breaks."""
    errors = []
    for imp in imports(root):
        importer, imported = _top(imp.importer), _top(imp.imported)
        where = f"{imp.importer} imports {imp.imported} (line {imp.line})"
        if imported == "benchmarks" and importer != "benchmarks":
            errors.append(f"{where}: nothing the service runs imports the benchmarks")
        elif importer == "benchmarks":
            continue  # the benchmarks drive every part, as the tests do
        elif importer == "kernels" and imported != "kernels":
            errors.append(f"{where}: kernels import nothing of tidegate's")
        elif importer in ROLES:
            allowed = {importer, "tidegate", *(["kernels"] if importer == "worker" else [])}
            if imported not in allowed:
                errors.append(f"{where}: a role imports tidegate (the worker also kernels), "
                              "never another role")
            elif _in(imp.imported, COMPOSITION_ROOT) or imp.imported == "tidegate.__main__":
                errors.append(f"{where}: nothing imports the composition root")
        elif importer == "tidegate":
            root_side = _in(imp.importer, COMPOSITION_ROOT) or imp.importer == "tidegate.__main__"
            if not root_side and imported != "tidegate":
                errors.append(f"{where}: only {COMPOSITION_ROOT} imports the roles")
            elif not root_side and _in(imp.imported, COMPOSITION_ROOT):
                errors.append(f"{where}: nothing imports the composition root")
            elif root_side and imported == "kernels":
                errors.append(f"{where}: kernels are the worker's")
    return errors


def circles(root: Path) -> list[list[str]]:
    """Every set of modules that import each other round a circle (Tarjan's SCCs)."""
    graph: dict[str, set[str]] = {name: set() for name in modules(root)}
    for imp in imports(root):
        graph[imp.importer].add(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _room(module: str, packages: set[str], depth: int) -> str | None:
    """The folder ``module`` lies in at ``depth`` dots below the top (its subfolders count as
    part of it); None where that level is a module of the folder above, not a folder."""
    parts = module.split(".")
    if len(parts) <= depth:
        return None
    room = ".".join(parts[: depth + 1])
    return room if room in packages else None


def folder_ties(root: Path) -> list[str]:
    """Each pair of sibling folders (under one package) that import each other both ways,
    with one import each way. A folder's own modules and its subfolders are one room: a parent
    importing its child and the child the parent's files is no tie. The composition root
    imports every role, so it is left out."""
    known = modules(root)
    packages = {name for name, path in known.items() if path.name == "__init__.py"}
    ways: dict[tuple[str, str], Import] = {}
    for imp in imports(root):
        if _in(imp.importer, COMPOSITION_ROOT) or _in(imp.imported, COMPOSITION_ROOT):
            continue
        a, b = imp.importer.split("."), imp.imported.split(".")
        depth = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if depth is None:
            continue  # one contains the other: the same room
        rooms = (_room(imp.importer, packages, depth), _room(imp.imported, packages, depth))
        if rooms[0] is not None and rooms[1] is not None:
            ways.setdefault((rooms[0], rooms[1]), imp)
    errors = []
    for (one, other), imp in sorted(ways.items()):
        back = ways.get((other, one))
        if back is not None and one < other:
            errors.append(f"{one} and {other} import each other: {imp.importer} imports "
                          f"{imp.imported} (line {imp.line}), {back.importer} imports "
                          f"{back.imported} (line {back.line}); one must go through an "
                          "interface the other owns")
    return errors


def undocumented_packages(root: Path) -> list[str]:
    """Folders of our packages without an ``__init__.py`` whose docstring says what they own."""
    missing = []
    for package in PACKAGES:
        for folder in [root / package, *(root / package).rglob("*")]:
            if not folder.is_dir() or folder.name == "__pycache__":
                continue
            if not any(folder.glob("*.py")):
                continue  # data only (streaming/static, kernels/cpu/csrc)
            init = folder / "__init__.py"
            if not init.exists() or not ast.get_docstring(ast.parse(init.read_text())):
                missing.append(str(folder.relative_to(root)))
    return missing


def test_imports_point_one_way() -> None:
    assert direction_errors(ROOT) == []


def test_no_import_circles() -> None:
    assert circles(ROOT) == []


def test_sibling_folders_import_one_way() -> None:
    assert folder_ties(ROOT) == []


def test_every_package_says_what_it_owns() -> None:
    assert undocumented_packages(ROOT) == []


def test_every_module_is_read() -> None:
    """The checks above see the whole source (a glob gone wrong would pass them vacuously)."""
    names = modules(ROOT)
    assert {"tidegate.producer.api", "tidegate.producer.submit.submit_path", "tidegate.worker.engine.engine",
            "tidegate.commands.cli", "tidegate.kernels.ops", "tidegate.streaming.gateway"} <= set(names)
    assert len(imports(ROOT)) > 300


def _tree(root: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(f'"""{package}."""\n')
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


@pytest.mark.parametrize(("files", "error"), [
    ({"producer/api.py": "from tidegate.worker.engine import Engine\n"},
     "never another role"),
    ({"streaming/gateway.py": "def f():\n    import tidegate.producer.api\n"},  # lazily, too
     "never another role"),
    ({"producer/api.py": "from tidegate.kernels import ops\n"}, "never another role"),
    ({"kernels/ops.py": "from tidegate import keys\n"}, "kernels import nothing"),
    ({"tidegate/keys.py": "from tidegate.worker import service\n"}, "only tidegate.commands imports"),
    ({"tidegate/commands/__init__.py": '"""root."""\n', "tidegate/commands/cli.py": "",
      "producer/api.py": "from tidegate.commands.cli import main\n"},
     "nothing imports the composition root"),
    ({"worker/x.py": "from tidegate.benchmarks.harness.run import stack\n",
      "benchmarks/harness/run/stack.py": ""}, "nothing the service runs imports the benchmarks"),
])
def test_a_wrong_import_is_named(tmp_path: Path, files: dict[str, str], error: str) -> None:
    [found] = direction_errors(_tree(tmp_path, files))
    assert error in found


def test_the_composition_root_may_import_the_roles(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"tidegate/commands/__init__.py": '"""root."""\n',
                            "tidegate/commands/cli.py": "def f():\n    from tidegate.worker import x\n",
                            "worker/x.py": "from tidegate.kernels import y\n", "kernels/y.py": ""})
    assert direction_errors(root) == []


def test_a_circle_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "producer/api.py": "from tidegate.producer.openai_routes import Routes\n",
        "producer/openai_routes.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from tidegate.producer.api import API\n",
        "producer/client.py": "from tidegate.producer import api\n"})
    assert circles(root) == [["tidegate.producer.api", "tidegate.producer.openai_routes"]]


def test_a_two_way_tie_between_sibling_folders_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "worker/engine/__init__.py": '"""engine."""\n',
        "worker/engine/engine.py": "from tidegate.worker.parallel.runner import Runner\n",
        "worker/engine/sampler.py": "",
        "worker/parallel/__init__.py": '"""parallel."""\n',
        "worker/parallel/ranks/__init__.py": '"""ranks."""\n',  # a subfolder is its folder's
        "worker/parallel/ranks/follower.py": "from tidegate.worker.engine import sampler\n",
        "worker/parallel/runner.py": ""})
    assert circles(root) == []  # no module circle: only the folders are tied
    [found] = folder_ties(root)
    assert found.startswith("tidegate.worker.engine and tidegate.worker.parallel import each "
                            "other: tidegate.worker.engine.engine imports "
                            "tidegate.worker.parallel.runner (line 1), "
                            "tidegate.worker.parallel.ranks.follower imports "
                            "tidegate.worker.engine.sampler (line 1)")


def test_a_parent_and_its_child_folder_are_one_room(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "worker/engine/__init__.py": '"""engine."""\n',
        "worker/engine/engine.py": "from tidegate.worker.engine.speculative import ngram\n",
        "worker/engine/sequence.py": "",
        "worker/engine/speculative/__init__.py": '"""speculative."""\n',
        "worker/engine/speculative/ngram.py": "from tidegate.worker.engine import sequence\n"})
    assert folder_ties(root) == []


def test_the_composition_root_ties_no_folders(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "tidegate/commands/__init__.py": '"""root."""\n',
        "tidegate/commands/cli.py": "from tidegate.model_files import source\n",
        "tidegate/model_files/__init__.py": '"""files."""\n',
        "tidegate/model_files/source.py": "def f():\n    from tidegate.commands import cli\n"})
    assert folder_ties(root) == []
    assert direction_errors(root) != []  # the other rule names that import


def test_an_undocumented_folder_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"worker/engine/engine.py": '"""The engine."""\n'})
    assert undocumented_packages(root) == ["worker/engine"]
