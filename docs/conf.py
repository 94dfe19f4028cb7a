"""Sphinx configuration of mpidist's documentation.

The pages are MyST Markdown (``*.md`` in this folder); the API reference (``api.md``) is
generated from the docstrings of the names in ``mpidist.__all__``, grouped by topic.

    pip install -e '.[docs]'
    python -m sphinx -W --keep-going -b html docs docs/_build/html

Warnings are errors (``-W``); ``tests/unit/test_docs.py`` builds it that way.
"""
from __future__ import annotations

import os
import sys

# Document the checkout this file belongs to, installed or not.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
import mpidist  # noqa: E402

project = "mpidist"
author = "the mpidist authors"
copyright = "the mpidist authors"
version = release = mpidist.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["deflist", "colon_fence"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"mpidist {release}"
html_theme_options = {"description": "TensorFlow-style distributed values and variables on MPI",
                      "fixed_sidebar": True}

# The API reference: each public name goes into the section of the private module it comes from.
API_SECTIONS = [
    ("Strategy", ("mpidist._distribute.strategy",)),
    ("Contexts", ("mpidist._distribute.context",)),
    ("Distributed values", ("mpidist._values.values",)),
    ("Variables", ("mpidist._distribute.variables",)),
    ("Reductions and options", ("mpidist._comm.reduce_op", "mpidist._options")),
    ("Input", ("mpidist._input.datasets", "mpidist._input.distributed", "mpidist._input.multistep",
               "mpidist._input.sharding")),
    ("Metrics", ("mpidist._distribute.metrics",)),
    ("Checkpoints", ("mpidist._checkpoint.checkpoint", "mpidist._checkpoint.reader")),
    ("Communicator", ("mpidist._comm.communicator", "mpidist._comm.handle")),
    ("Errors", ("mpidist._errors",)),
]


def api_groups() -> list[tuple[str, list[str]]]:
    """``[(section title, [public names])]`` covering every name of ``mpidist.__all__`` once."""
    groups: dict[str, list[str]] = {title: [] for title, _ in API_SECTIONS}
    other: list[str] = []
    for name in mpidist.__all__:
        if name.startswith("__"):
            continue
        module = getattr(getattr(mpidist, name), "__module__", "") or ""
        title = next((t for t, modules in API_SECTIONS if module in modules), None)
        (groups[title] if title else other).append(name)
    result = [(title, names) for title, names in groups.items() if names]
    if other:
        result.append(("Other", other))
    return result


def api_rst() -> list[str]:
    """reStructuredText lines of the API reference: a section per topic, an autodoc entry per name."""
    lines: list[str] = []
    for title, names in api_groups():
        lines += [title, "-" * len(title), ""]
        for name in names:
            obj = getattr(mpidist, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                kind = "autoexception"
            elif isinstance(obj, type):
                kind = "autoclass"
            elif callable(obj):
                kind = "autofunction"
            else:
                kind = "autodata"
            lines += [f".. {kind}:: mpidist.{name}", ""]
    return lines


def setup(app):
    # Sphinx is imported here only, so that tests can import api_groups() without it.
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    class MpidistApi(SphinxDirective):
        """``.. mpidist-api::``: autodoc entries for every name in ``mpidist.__all__``, by section."""

        def run(self):
            from docutils import nodes

            container = nodes.section()
            container.document = self.state.document
            nested_parse_with_titles(self.state, StringList(api_rst(), source="mpidist.__all__"), container)
            return container.children

    app.add_directive("mpidist-api", MpidistApi)
    return {"parallel_read_safe": True}
