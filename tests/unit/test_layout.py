"""The package layout is the architecture: layers import only downwards, mpi4py stays in comm and tools.

Serial, by reading the source (no imports are executed): every import of a module counts,
also those inside functions; only ``if TYPE_CHECKING:`` blocks are skipped.
"""

import ast
from pathlib import Path

import pytest

from paths import REPO

PACKAGE = REPO / "mpidist"
# Lower layers first; a module may import from its own layer and the ones before it.
LAYERS = ["_top", "_comm", "_values", "_input", "_distribute", "_checkpoint", "_tools", "examples", "_surface"]
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    if parts in (("__init__.py",), ("__main__.py",)):
        return "_surface"  # the public names and the command line: above every layer
    return parts[0] if len(parts) > 1 else "_top"


def descendants(node: ast.AST):
    """Every node under ``node``, at any depth, except what lies in ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        yield child
        yield from descendants(child)


def imports(path: Path):
    """(imported module, imported names) of every import in the module, in functions too (TYPE_CHECKING skipped)."""
    for node in descendants(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [alias.name for alias in node.names]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_comm_and_tools_import_mpi4py(path):
    if layer(path) in ("_comm", "_tools"):
        return
    imported = [m for m, _ in imports(path) if m.split(".")[0] == "mpi4py"]
    assert not imported, f"{path.relative_to(PACKAGE)} imports {imported}; MPI belongs to mpidist/_comm"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_import_only_downwards_and_no_private_names_across_subpackages(path):
    mine = layer(path)
    for module, names in imports(path):
        if not module.startswith("mpidist."):
            continue
        theirs = module.split(".")[1]
        theirs = theirs if theirs in LAYERS else "_top"
        assert LAYERS.index(theirs) <= LAYERS.index(mine), (
            f"{path.relative_to(PACKAGE)} imports {module} (a higher layer)"
        )
        if theirs != mine and theirs != "_top":
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{path.relative_to(PACKAGE)} imports private {private} from {module}"


def test_values_need_no_mpi_and_nothing_above_them():
    imported = [m for m, _ in imports(PACKAGE / "_values" / "values.py")]
    assert all(m.split(".")[0] != "mpi4py" for m in imported), imported
    assert not [
        m for m in imported if m.startswith("mpidist.") and m not in ("mpidist._values.nest", "mpidist._errors")
    ], imported


def test_input_needs_no_strategy_not_even_for_types():
    """The input layer depends on its InputHost protocol, never on the strategy (not even under TYPE_CHECKING)."""
    for path in sorted((PACKAGE / "_input").glob("*.py")):
        assert "mpidist._distribute" not in path.read_text(), f"_input/{path.name} refers to mpidist._distribute"


# Underscore names that are public by convention: namedtuple's API, and os._exit.
PUBLIC_UNDERSCORE_NAMES = {"_asdict", "_fields", "_make", "_replace", "_exit"}


def defined_private_names(tree: ast.AST) -> set[str]:
    """The underscore names a module defines itself: its functions, classes, class attributes,
    ``__slots__`` entries and every ``x._name = ...`` it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and node.value is not None:
                names.update(
                    e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)
                )
    return {n for n in names if n.startswith("_")}


def foreign_private_attributes(source: str) -> list[str]:
    """``"line: expression"`` for each underscore attribute a module's ``source`` reads that another module owns.

    A module owns the underscore names it defines (:func:`defined_private_names`): it may read them
    on any object of its own classes (``self._x``, ``dataset._leaves`` in the module of the dataset
    class). Dunder names and namedtuple's API are public. Anything else (``v._component`` outside
    the variables module, ``np._x``, ``MPI._y``) belongs to another module.
    """
    tree = ast.parse(source)
    own = defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if (node.attr.startswith("__") and node.attr.endswith("__")) or node.attr in PUBLIC_UNDERSCORE_NAMES:
            continue
        if node.attr in own:
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reads_another_objects_underscore_attributes(path):
    """Modules meet through public names (``v.component``, ``strategy.extended``), never each other's ``_x``."""
    found = foreign_private_attributes(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)} reads underscore attributes of other objects: {'; '.join(found)}"


def test_the_private_check_catches_a_variables_component():
    source = (
        "class A:\n    __slots__ = ('_s',)\n    _y = 1\n    def __init__(self):\n        self._x = 0\n"
        "    def f(self, v, other):\n"
        "        return (self._x, A._y, other._s, super()._f, v.__class__, type(v)._fields,\n"
        "                v._component, np._w)\n    def _f(self):\n        pass\n"
    )
    assert foreign_private_attributes(source) == ["8: v._component", "8: np._w"]
