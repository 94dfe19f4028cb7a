"""Where the program called mpidist: the ``file:line`` of the first frame outside the package.

For messages only (a stalled collective, ranks that disagree): the walk up the
stack runs on error paths and when a call is planned the first time, never per
collective. The main job (``mpidist/examples/``) counts as the program.
"""

from __future__ import annotations

import inspect
import os
import warnings
from types import FrameType
from typing import Optional

__all__ = ["Site", "call_site", "caller", "site_text", "warn_at_caller"]

_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep  # mpidist/, spelt as code objects spell it
_EXAMPLES = _PACKAGE + "examples" + os.sep

Site = Optional[tuple[str, int]]  # (file, line) as Python names them, or None: no frame outside mpidist


def call_site() -> str:
    """Local: ``file:line`` of the innermost frame outside mpidist (the program's call), or ``""`` if none."""
    return site_text(caller())


def caller() -> Site:
    """Local: (file, line) of the innermost frame outside mpidist; ``None`` if none. Cheap: no formatting."""
    frame: Optional[FrameType] = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # never keep this frame in its own locals: a cycle
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_PACKAGE) or name.startswith(_EXAMPLES):
            return name, frame.f_lineno
        frame = frame.f_back
    return None


def site_text(site: Site) -> str:
    """Local: ``file:line`` of a :func:`caller`, the file relative to the working directory when it lies below
    it; ``""`` for ``None``."""
    if site is None:
        return ""
    name, line = site
    try:
        relative = os.path.relpath(name)
    except ValueError:  # another drive (Windows)
        relative = name
    return f"{name if relative.startswith(os.pardir) else relative}:{line}"


def warn_at_caller(message: str) -> None:
    """Local: a :class:`RuntimeWarning` shown at the program's call into mpidist (its ``file:line``)."""
    found = caller()
    if found is None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    else:
        warnings.warn_explicit(message, RuntimeWarning, *found)
