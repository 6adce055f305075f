"""Imports flow one way: meshes <- sharding <- models <- experiments."""

import ast
import pathlib

import pytest

from tests.conftest import REPO

ALLOWED = {
    "meshes": set(),
    "sharding": {"meshes"},
    "models": {"meshes", "sharding"},
    "experiments": {"meshes", "sharding", "models"},
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package):
    own = set(ALLOWED)
    for path in pathlib.Path(REPO, package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top in own and top != package:
                    assert top in ALLOWED[package], f"{path}: {package} imports {top}"
