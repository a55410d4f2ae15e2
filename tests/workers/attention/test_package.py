"""The attention package: its registry, a flashinfer-free import, and no module cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import workers.attention
from workers.attention import get_backend, register_backend
from workers.attention.torch_backend import TorchBackend

PACKAGE = Path(workers.attention.__file__).parent


def test_unknown_backend_lists_the_known_names() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*\['flashinfer', 'torch'\]"):
        get_backend("nope")


def test_each_call_builds_a_fresh_backend() -> None:
    first, second = get_backend("torch"), get_backend("torch")
    assert isinstance(first, TorchBackend) and first is not second


def test_registered_factory_is_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers.attention, "_REGISTRY", dict(workers.attention._REGISTRY))
    register_backend("mine", TorchBackend)
    assert isinstance(get_backend("mine"), TorchBackend)
    with pytest.raises(ValueError, match="'mine'"):
        get_backend("missing")


def test_import_loads_no_backend_and_no_flashinfer() -> None:
    code = (
        "import sys, workers.attention, workers.attention.schemes\n"
        "loaded = [m for m in sys.modules if 'flashinfer' in m]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> set[str]:
    """Modules of `workers.attention` imported anywhere (functions too), bar TYPE_CHECKING."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # `from workers.attention import ops` imports a module, not a name of the package.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return {name for name in found if name.startswith("workers.attention")}


def test_no_import_cycles() -> None:
    modules = {
        ("workers.attention" if p.stem == "__init__" else f"workers.attention.{p.stem}"): p
        for p in PACKAGE.glob("*.py")
    }
    graph = {
        name: _runtime_imports(ast.parse(path.read_text())) & set(modules) - {name}
        for name, path in modules.items()
    }
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :] + [name]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
