"""Which MPI library this process loaded: its version line, its shared objects, its control variables.

Local: reads what the library reports and the process's memory map, and reads or writes
the library's integer control variables through its tool interface (MPI_T, which mpi4py
does not wrap: called through :mod:`ctypes` on the ``libmpi`` already loaded); no
communication. Part of the comm layer.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

from mpi4py import MPI

__all__ = ["libmpi", "libmpi_paths", "library_version", "read_control_variable", "write_control_variable"]


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


def read_control_variable(name: str) -> int:
    """Local: the value of the library's integer control variable ``name`` (MPI_T), e.g. an MCA parameter.

    Raises :class:`OSError` when the library has no such variable, it is not one
    ``int``, or the tool interface cannot be reached.
    """
    with _control_variable(name) as (lib, handle):
        value = ctypes.c_int()
        _check(lib.MPI_T_cvar_read(handle, ctypes.byref(value)), f"MPI_T_cvar_read({name!r})")
        return value.value


def write_control_variable(name: str, value: int) -> None:
    """Local: set the library's integer control variable ``name`` (MPI_T) in this process.

    Raises :class:`OSError` as :func:`read_control_variable` does, or when the library
    refuses the write (a variable fixed once MPI has started).
    """
    with _control_variable(name) as (lib, handle):
        _check(lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(value))), f"MPI_T_cvar_write({name!r}, {value})")


@functools.cache
def libmpi() -> ctypes.CDLL:
    """Local: the ``libmpi`` this process has loaded, never a second copy (a new ``dlopen`` would be one).

    Raises :class:`OSError` when no ``libmpi.so`` is mapped into this process.
    """
    for path in libmpi_paths():
        if os.path.basename(path).startswith("libmpi.so"):
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    raise OSError(f"no libmpi.so among this process's shared objects ({', '.join(libmpi_paths()) or 'none found'})")


def _check(code: int, call: str) -> None:
    if code != 0:  # MPI_SUCCESS
        raise OSError(f"{call} returned error code {code}")


@contextmanager
def _control_variable(name: str) -> Iterator[tuple[ctypes.CDLL, ctypes.c_void_p]]:
    """An MPI_T session with a handle on the single-``int`` control variable ``name``, all freed after."""
    lib = libmpi()
    if not hasattr(lib, "MPI_T_cvar_get_index"):  # MPI_T came with MPI 3.0, the lookup by name with 3.1
        raise OSError("the MPI library has no MPI_T_cvar_get_index (MPI 3.1's tool interface)")
    provided = ctypes.c_int()
    _check(lib.MPI_T_init_thread(MPI.THREAD_SINGLE, ctypes.byref(provided)), "MPI_T_init_thread")
    try:
        index, count = ctypes.c_int(), ctypes.c_int()
        _check(lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)), f"MPI_T_cvar_get_index({name!r})")
        datatype, no_length = ctypes.c_void_p(), ctypes.c_int(0)
        _check(
            lib.MPI_T_cvar_get_info(
                index,
                None,
                ctypes.byref(no_length),
                None,
                ctypes.byref(datatype),
                None,
                None,
                ctypes.byref(ctypes.c_int(0)),
                None,
                None,
            ),
            f"MPI_T_cvar_get_info({name!r})",
        )
        if (datatype.value or 0) != MPI.INT.handle:
            raise OSError(f"control variable {name!r} is not an MPI_INT")
        handle = ctypes.c_void_p()
        _check(
            lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)),
            f"MPI_T_cvar_handle_alloc({name!r})",
        )
        try:
            if count.value != 1:
                raise OSError(f"control variable {name!r} holds {count.value} values, not one")
            yield lib, handle
        finally:
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        lib.MPI_T_finalize()
