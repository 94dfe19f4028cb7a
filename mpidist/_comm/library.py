"""Which MPI library this process loaded: its version line and its shared objects.

Local: reads what the library reports and the process's memory map; no
communication. Part of the comm layer.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["libmpi_paths", "library_version"]


def library_version() -> str:
    """The MPI library's name and version on one line, e.g. ``"Open MPI v5.0.11"``, ``"MPICH Version: 5.0.2"``.

    Local. The first line of ``MPI.Get_library_version()`` with its whitespace
    collapsed and without the build details Open MPI appends after ``", package:"``.
    """
    first = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    return " ".join(first.split(", package:")[0].split())


def libmpi_paths() -> list[str]:
    """Local: the ``libmpi`` shared objects mapped into this process, sorted (empty when unknown)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "/libmpi" in line and line.split()[-1].startswith("/")})
    except OSError:
        return []
