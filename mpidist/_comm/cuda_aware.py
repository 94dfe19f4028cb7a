"""Whether MPI may be handed GPU buffers: the three-state ``cuda_aware`` setting.

``"1"`` and ``"0"`` are taken as given. ``"auto"`` asks the loaded MPI library
(``MPIX_Query_cuda_support``, which Open MPI and MPICH export) and, when it
claims support, confirms with one device-buffer allreduce checked against the
expected host result, because the query has been known to reflect build flags
rather than the runtime. Part of the comm layer.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from typing import Optional

from mpi4py import MPI

from mpidist._comm.backend import Backend
from mpidist._comm.library import libmpi_paths

__all__ = ["library_cuda_support", "resolve_cuda_aware"]


def library_cuda_support() -> Optional[bool]:
    """What the loaded MPI library says of CUDA support (``None``: it has no query)."""
    for path in libmpi_paths():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            query = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return None


def resolve_cuda_aware(comm: MPI.Intracomm, backend: Backend, setting: str) -> bool:
    """Collective over ``comm`` (for GPU backends): whether MPI may be handed device buffers.

    Host backends never hand device buffers to MPI: ``False`` without communicating.
    With ``"auto"``, every rank must agree, so the answer is the MIN over ranks, and rank 0
    warns once when it falls back to host staging.
    """
    if not backend.is_gpu:
        return False
    if setting in ("0", "1"):
        return setting == "1"
    ok = bool(library_cuda_support()) and _self_test(comm, backend)
    agreed = bool(comm.allreduce(int(ok), op=MPI.MIN))
    if not agreed and comm.rank == 0:
        warnings.warn("mpidist: MPI is not CUDA-aware (or its self-test failed): GPU arrays are "
                      "staged through pinned host memory. Set MPIDIST_CUDA_AWARE=1 to skip the check "
                      "on an MPI you know is CUDA-aware.", RuntimeWarning, stacklevel=4)
    return agreed


def _self_test(comm: MPI.Intracomm, backend: Backend) -> bool:
    """One device-buffer allreduce compared against the host result."""
    xp = backend.xp
    probe = xp.full(1024, comm.rank + 1, dtype=xp.float64)
    backend.synchronize()
    try:
        comm.Allreduce(MPI.IN_PLACE, probe, MPI.SUM)
    except MPI.Exception:
        return False
    return bool((probe == comm.size * (comm.size + 1) / 2).all())
