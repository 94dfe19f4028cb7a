"""The comm layer has no import circle (serial: reads the source, imports nothing).

Edges are the module-level imports between modules of ``mpidist/_comm``
(its subpackages included); imports under ``if TYPE_CHECKING:`` do not count,
nor does a package's ``__init__`` that Python runs before a submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from paths import REPO as ROOT

COMM = ROOT / "mpidist" / "_comm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(COMM.rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(path: Path) -> set[str]:
    """The modules of the comm layer that ``path`` imports at module level (not under TYPE_CHECKING)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                if not _type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 packages
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`

    visit(ast.parse(path.read_text(), str(path)).body)
    return {name for name in found if name in MODULES and name != module_name(path)}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as a list of modules (first == last), or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return []


def test_the_comm_layer_has_no_import_circle():
    graph = {name: module_imports(path) for name, path in MODULES.items()}
    assert "mpidist._comm.transport" in graph and graph["mpidist._comm.communicator"], graph
    cycle = find_cycle(graph)
    assert not cycle, "import circle in the comm layer: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"a"}}, ["a", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"e"}, "e": {"d"}}, ["d", "e", "d"]),
    ],
)
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_type_checking_imports_do_not_count():
    handle = COMM / "handle.py"
    assert "mpidist._comm.agreement" in handle.read_text()  # imported for its annotations only
    assert "mpidist._comm.agreement" not in module_imports(handle)
