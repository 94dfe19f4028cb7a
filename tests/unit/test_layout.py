"""The package layout is the architecture: layers import only downwards, mpi4py stays in comm and tools.

Serial, by reading the source (no imports are executed): module-level imports only, so that
the strategy may still hand work to the input layer from inside a method.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpidist"
# Lower layers first; a module may import from its own layer and the ones before it.
LAYERS = ["_top", "_comm", "_values", "_distribute", "_input", "_checkpoint", "_tools", "examples", "_surface"]
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    if parts in (("__init__.py",), ("__main__.py",)):
        return "_surface"  # the public names and the command line: above every layer
    return parts[0] if len(parts) > 1 else "_top"


def module_level_imports(path: Path):
    """(imported module, imported names) of the module's top-level statements (TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node):
            if isinstance(sub, ast.Import):
                for alias in sub.names:
                    yield alias.name, []
            elif isinstance(sub, ast.ImportFrom) and sub.module:
                yield sub.module, [alias.name for alias in sub.names]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_comm_and_tools_import_mpi4py(path):
    if layer(path) in ("_comm", "_tools"):
        return
    imported = [m for m, _ in module_level_imports(path) if m.split(".")[0] == "mpi4py"]
    assert not imported, f"{path.relative_to(PACKAGE)} imports {imported}; MPI belongs to mpidist/_comm"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_import_only_downwards_and_no_private_names_across_subpackages(path):
    mine = layer(path)
    for module, names in module_level_imports(path):
        if not module.startswith("mpidist."):
            continue
        theirs = module.split(".")[1]
        theirs = theirs if theirs in LAYERS else "_top"
        assert LAYERS.index(theirs) <= LAYERS.index(mine), f"{path.relative_to(PACKAGE)} imports {module} (a higher layer)"
        if theirs != mine and theirs != "_top":
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{path.relative_to(PACKAGE)} imports private {private} from {module}"


def test_values_need_no_mpi_and_nothing_above_them():
    imported = [m for m, _ in module_level_imports(PACKAGE / "_values" / "values.py")]
    assert all(m.split(".")[0] != "mpi4py" for m in imported), imported
    assert not [m for m in imported if m.startswith("mpidist.") and m not in
                ("mpidist._values.nest", "mpidist._errors")], imported
