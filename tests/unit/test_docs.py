"""The documentation: every public name has a docstring, and the Sphinx site builds without warnings.

Like mpi4py's ``test/test_doc.py``: a public name, or a public method or property of a public
class, without a docstring fails here. The build runs ``sphinx-build -W`` (warnings are
errors) into a temporary folder; it is skipped only where Sphinx is not installed (the
``docs`` extra; ``python3 tests/run.py`` installs it).
"""

from __future__ import annotations

import enum
import inspect
import re
import subprocess
import sys

import pytest

import mpidist
from paths import REPO

DOCS = REPO / "docs"


def _public_names():
    return [name for name in mpidist.__all__ if not name.startswith("__")]


def _attributes_section(cls):
    """Names documented in the ``Attributes:`` section of ``cls``'s docstring (Google style)."""
    doc = inspect.getdoc(cls) or ""
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
    return set(re.findall(r"^[ \t]+(\w+)( \(.*\))?:", match.group(1), re.M)) if match else set()


def _undocumented_members(cls):
    """Public methods and properties that ``cls`` itself defines without a docstring.

    A property described in the class docstring's ``Attributes:`` section counts as documented
    (napoleon renders it there; a docstring of its own would describe it twice).
    """
    missing = []
    in_class_doc = {name for name, _ in _attributes_section(cls)}
    for name, member in vars(cls).items():
        if (
            name in in_class_doc
            or name.startswith("_")
            or isinstance(member, enum.Enum)
            or (issubclass(cls, enum.Enum) and name in cls.__members__)
        ):
            continue
        target = member.fget if isinstance(member, property) else member
        if isinstance(target, (staticmethod, classmethod)):
            target = target.__func__
        if not (inspect.isfunction(target) or isinstance(member, property)):
            continue  # plain class attributes (constants) document themselves in the class docstring
        if not (inspect.getdoc(target) or "").strip():
            missing.append(f"{cls.__name__}.{name}")
    return missing


def test_every_public_name_has_a_docstring():
    missing = [name for name in _public_names() if not (getattr(getattr(mpidist, name), "__doc__", None) or "").strip()]
    assert not missing, f"public names without a docstring: {', '.join(missing)}"


def test_every_public_method_and_property_has_a_docstring():
    missing = []
    for name in _public_names():
        obj = getattr(mpidist, name)
        if isinstance(obj, type):
            missing += _undocumented_members(obj)
    assert not missing, f"public methods/properties without a docstring: {', '.join(missing)}"


def test_api_reference_covers_every_public_name():
    sys.path.insert(0, str(DOCS))
    try:
        import conf  # docs/conf.py: the API page lists exactly the groups it computes
    finally:
        sys.path.remove(str(DOCS))
    listed = [name for _, names in conf.api_groups() for name in names]
    assert sorted(listed) == sorted(_public_names())
    assert len(listed) == len(set(listed))
    assert "mpidist-api" in (DOCS / "api.md").read_text()


def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="Sphinx is not installed (pip install -e '.[docs]')")
    pytest.importorskip("myst_parser", reason="myst-parser is not installed (pip install -e '.[docs]')")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(DOCS),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stdout}\n{result.stderr}"
    api = (tmp_path / "html" / "api.html").read_text()
    for name in _public_names():
        assert re.search(rf'id="mpidist\.{re.escape(name)}"', api), f"mpidist.{name} is missing from api.html"
