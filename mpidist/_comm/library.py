"""Which MPI library this process loaded: its version line, its shared objects, its tool variables.

Local: reads what the library reports and the process's memory map, reads or writes the
library's integer control variables and reads its performance variables through its tool
interface (MPI_T, which mpi4py does not wrap: called through :mod:`ctypes` on the ``libmpi``
already loaded); no communication. Part of the comm layer.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional, Union

from mpi4py import MPI

__all__ = [
    "PerformanceVariables",
    "libmpi",
    "libmpi_paths",
    "library_version",
    "read_control_variable",
    "write_control_variable",
]


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


# The C types of the integer MPI datatypes a performance variable may have.
_CType = Union[type[ctypes.c_ulonglong], type[ctypes.c_ulong], type[ctypes.c_uint]]
_PVAR_TYPES: tuple[tuple[MPI.Datatype, _CType], ...] = (
    (MPI.UNSIGNED_LONG_LONG, ctypes.c_ulonglong),
    (MPI.UNSIGNED_LONG, ctypes.c_ulong),
    (MPI.UNSIGNED, ctypes.c_uint),
)


class PerformanceVariables:
    """Local: the library's integer performance variables ``names`` (MPI_T "pvars"), bound to ``comm``, started.

    Each variable holds one or more counters (Open MPI's ``pml_monitoring_messages_count``, with
    its monitoring on: one per rank of ``comm``, the messages this process sent to it); :meth:`read`
    returns their values now. A variable bound to no object ignores ``comm``. :meth:`free` ends
    the session. Raises :class:`OSError` when the library has no variable of one of the names
    (MPICH builds include none unless configured with ``--enable-mpit-pvars``), one is not of an
    unsigned integer type, or the tool interface fails.
    """

    def __init__(self, names: Sequence[str], comm: MPI.Comm) -> None:
        lib = libmpi()
        self._lib: Optional[ctypes.CDLL] = lib
        if not hasattr(lib, "MPI_T_pvar_session_create"):
            raise OSError("the MPI library has no MPI_T_pvar_session_create (MPI 3.0's tool interface)")
        provided = ctypes.c_int()
        _check(lib.MPI_T_init_thread(MPI.THREAD_SINGLE, ctypes.byref(provided)), "MPI_T_init_thread")
        self._session = ctypes.c_void_p()
        self._handles: dict[str, tuple[ctypes.c_void_p, _CType, int]] = {}
        try:
            found = _integer_variables(lib)
            missing = [name for name in names if name not in found]
            if missing:
                offered = f": {', '.join(sorted(found)[:8])}{', ...' if len(found) > 8 else ''}" if found else ""
                raise OSError(
                    f"the MPI library has no performance variable {', '.join(missing)} "
                    f"(it offers {len(found)} of an integer type{offered})"
                )
            _check(lib.MPI_T_pvar_session_create(ctypes.byref(self._session)), "MPI_T_pvar_session_create")
            bound = ctypes.c_void_p(comm.handle)  # MPI_Comm is a pointer (Open MPI) or an int (MPICH): either fits
            for name in names:
                index, ctype, continuous = found[name]
                handle, count = ctypes.c_void_p(), ctypes.c_int()
                _check(
                    lib.MPI_T_pvar_handle_alloc(
                        self._session, index, ctypes.byref(bound), ctypes.byref(handle), ctypes.byref(count)
                    ),
                    f"MPI_T_pvar_handle_alloc({name!r})",
                )
                self._handles[name] = (handle, ctype, count.value)
                if not continuous:
                    _check(lib.MPI_T_pvar_start(self._session, handle), f"MPI_T_pvar_start({name!r})")
        except BaseException:
            self.free()
            raise

    def read(self) -> dict[str, list[int]]:
        """Local: every variable's counters now, by name."""
        assert self._lib is not None, "read after free()"
        values = {}
        for name, (handle, ctype, count) in self._handles.items():
            buffer = (ctype * count)()
            _check(self._lib.MPI_T_pvar_read(self._session, handle, buffer), f"MPI_T_pvar_read({name!r})")
            values[name] = [int(v) for v in buffer]
        return values

    def free(self) -> None:
        """Local: free the handles and the session, and leave the tool interface (once; later calls do nothing)."""
        if self._lib is None:
            return
        for handle, _, _ in self._handles.values():
            self._lib.MPI_T_pvar_handle_free(self._session, ctypes.byref(handle))
        self._handles.clear()
        if self._session.value:
            self._lib.MPI_T_pvar_session_free(ctypes.byref(self._session))
        self._lib.MPI_T_finalize()
        self._lib = None


def _integer_variables(lib: ctypes.CDLL) -> dict[str, tuple[int, _CType, bool]]:
    """Every performance variable of an unsigned integer type: its index, C type, and whether it is continuous."""
    number = ctypes.c_int()
    _check(lib.MPI_T_pvar_get_num(ctypes.byref(number)), "MPI_T_pvar_get_num")
    types = {datatype.handle: ctype for datatype, ctype in _PVAR_TYPES}
    found = {}
    for index in range(number.value):
        name, name_len = ctypes.create_string_buffer(256), ctypes.c_int(256)
        verbosity, var_class, bind, readonly, continuous, atomic = (ctypes.c_int() for _ in range(6))
        datatype, enumtype, no_length = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int(0)
        code = lib.MPI_T_pvar_get_info(
            index,
            name,
            ctypes.byref(name_len),
            ctypes.byref(verbosity),
            ctypes.byref(var_class),
            ctypes.byref(datatype),
            ctypes.byref(enumtype),
            None,
            ctypes.byref(no_length),
            ctypes.byref(bind),
            ctypes.byref(readonly),
            ctypes.byref(continuous),
            ctypes.byref(atomic),
        )
        ctype = types.get(datatype.value or 0)
        if code == 0 and ctype is not None:  # a variable no longer valid, or not an integer: not offered
            found[name.value.decode()] = (index, ctype, bool(continuous.value))
    return found
