"""The house: imports flow one way between packages (meshes <- sharding <- models <-
experiments), and no module of a package imports itself back through its neighbours."""

import ast
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import REPO

ALLOWED = {
    "meshes": set(),
    "sharding": {"meshes"},
    "models": {"meshes", "sharding"},
    "experiments": {"meshes", "sharding", "models"},
}


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module a file imports (at any depth, function-level imports included), with
    `from package import name` read as the submodule `package.name` where one exists.
    Imports under `if TYPE_CHECKING:` never run (annotations only) and are left out."""
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
                "TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            for a in node.names:
                sub = pathlib.Path(REPO, *node.module.split("."), f"{a.name}.py")
                if sub.exists():
                    out.append(f"{node.module}.{a.name}")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def package_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (the package's own __init__,
    which every submodule import passes through, left out)."""
    graph = {}
    for path in sorted(pathlib.Path(REPO, package).glob("*.py")):
        if path.stem == "__init__":
            continue
        name = f"{package}.{path.stem}"
        graph[name] = {m for m in imported_modules(path)
                       if m.startswith(f"{package}.") and m.count(".") == 1 and m != name}
    return graph


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package):
    own = set(ALLOWED)
    for path in pathlib.Path(REPO, package).rglob("*.py"):
        for n in imported_modules(path):
            top = n.split(".")[0]
            if top in own and top != package:
                assert top in ALLOWED[package], f"{path}: {package} imports {top}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle_inside_a_package(package):
    cycle = find_cycle(package_graph(package))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def test_the_code_passes_the_linter():
    # ruff with the project's settings (pyproject.toml): pyflakes, pycodestyle, import order.
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-1000:]


def test_imports_for_annotations_only_are_not_edges(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nimport json\n"
                    "if TYPE_CHECKING:\n    import sharding.report\n")
    assert imported_modules(path) == ["typing", "json"]


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    # The api <-> backends pair this test was written for.
    assert find_cycle({"s.api": {"s.backends"}, "s.backends": {"s.api"}}) is not None


def test_no_tracked_file_holds_a_machine_path():
    # HLO fixtures name their source files; those names must not be the generating
    # machine's absolute paths (this file names the prefixes, so it is left out).
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        path = pathlib.Path(REPO, name)
        if path.suffix not in (".py", ".hlo", ".toml", ".md", ".txt") or \
                path.name == "test_layout.py":
            continue
        text = path.read_text(errors="replace")
        for prefix in ("/work/", "/root/", "/home/"):
            assert prefix not in text, f"{name} holds a machine path ({prefix}...)"
