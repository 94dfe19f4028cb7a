"""Whether MPI may be handed GPU buffers: the three-state ``cuda_aware`` setting.

``"1"`` and ``"0"`` are taken as given. ``"auto"`` asks the loaded MPI library
(``MPIX_Query_cuda_support``, which Open MPI and MPICH export) and, when it
claims support, confirms with one device-buffer allreduce checked against the
expected host result, because the query has been known to reflect build flags
rather than the runtime. Part of the comm layer.

The decision and its reason are reported once per process on rank 0 (the
``mpidist.comm`` logger, level INFO; a warning when ``"auto"`` falls back to
staging) and returned by :func:`decide_cuda_aware` for reports.
"""

from __future__ import annotations

import ctypes
import logging
import warnings
from dataclasses import dataclass
from typing import Optional

from mpi4py import MPI

from mpidist._comm.backend import Backend
from mpidist._comm.library import libmpi
from mpidist._errors import on_rank

__all__ = ["CudaAwareness", "decide_cuda_aware", "library_cuda_support", "resolve_cuda_aware"]

logger = logging.getLogger("mpidist.comm")


def library_cuda_support() -> Optional[bool]:
    """What the loaded MPI library says of CUDA support (``None``: it has no query)."""
    try:
        query = libmpi().MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


@dataclass(frozen=True)
class CudaAwareness:
    """Whether MPI is handed device buffers, and why.

    ``source`` is where the answer came from: ``"host"`` (a host backend: no
    device buffers), ``"setting"`` (``cuda_aware`` ``"1"``/``"0"``, from the
    options or ``MPIDIST_CUDA_AWARE``), ``"query"`` (``MPIX_Query_cuda_support``
    said no, or the library has no such query) or ``"self-test"`` (the
    device-buffer allreduce confirmed or refuted the query).
    """

    enabled: bool
    reason: str
    source: str

    def describe(self) -> str:
        """One line: the transfer path in use and why."""
        path = (
            "device buffers go to MPI directly (CUDA-aware)"
            if self.enabled
            else "device buffers are staged through pinned host memory"
        )
        return f"{path}: {self.reason}"


# Outcomes of "auto", worst first: the ranks agree on the MIN.
_NO_QUERY, _QUERY_NO, _SELF_TEST_FAILED, _CONFIRMED = range(4)
_AUTO_REASONS = {
    _NO_QUERY: (
        "query",
        "cuda_aware='auto' and the MPI library has no CUDA-support query "
        "(MPIX_Query_cuda_support) on at least one rank",
    ),
    _QUERY_NO: (
        "query",
        "cuda_aware='auto' and MPIX_Query_cuda_support() says the MPI library is not CUDA-aware on at least one rank",
    ),
    _SELF_TEST_FAILED: (
        "self-test",
        "cuda_aware='auto': the MPI library claims CUDA support, but the one-time "
        "device-buffer allreduce failed or gave a wrong sum on at least one rank",
    ),
    _CONFIRMED: (
        "self-test",
        "cuda_aware='auto': the MPI library claims CUDA support and the one-time "
        "device-buffer allreduce gave the right sum on every rank",
    ),
}
_reported: set[CudaAwareness] = set()


def decide_cuda_aware(comm: MPI.Intracomm, backend: Backend, setting: str) -> CudaAwareness:
    """Collective over ``comm`` for GPU backends (local for host backends): the decision and its reason.

    ``setting`` is the ``cuda_aware`` option: ``"1"`` and ``"0"`` are taken
    as given; ``"auto"`` agrees on the query across the ranks, then runs the
    device-buffer self-test on every rank, and enables direct transfers only
    when every rank passed.
    """
    if not backend.is_gpu:
        return CudaAwareness(False, "host arrays: no device buffers to hand to MPI", "host")
    if setting in ("0", "1"):
        state = "on" if setting == "1" else "off"
        return CudaAwareness(
            setting == "1",
            f"cuda_aware={setting!r} (MPIDIST_CUDA_AWARE or the options) turns it {state} without a check",
            "setting",
        )
    if setting != "auto":
        raise ValueError(f"cuda_aware must be '1', '0' or 'auto', got {setting!r}")
    supported = library_cuda_support()
    outcome = _NO_QUERY if supported is None else (_QUERY_NO if not supported else _CONFIRMED)
    outcome = int(comm.allreduce(outcome, op=MPI.MIN))  # every rank runs the self-test, or none
    if outcome == _CONFIRMED:
        passed = _self_test(comm, backend)
        outcome = int(comm.allreduce(_CONFIRMED if passed else _SELF_TEST_FAILED, op=MPI.MIN))
    source, reason = _AUTO_REASONS[outcome]
    return CudaAwareness(outcome == _CONFIRMED, reason, source)


def resolve_cuda_aware(comm: MPI.Intracomm, backend: Backend, setting: str) -> CudaAwareness:
    """Collective over ``comm`` (for GPU backends): whether MPI may be handed device buffers, and why.

    Host backends never hand device buffers to MPI: ``False`` without
    communicating. See :func:`decide_cuda_aware`. The first time a decision
    is made in a process, rank 0 logs it with its reason (``mpidist.comm``,
    INFO), and warns when ``"auto"`` falls back to host staging.
    """
    decision = decide_cuda_aware(comm, backend, setting)
    if decision.source != "host" and comm.rank == 0 and decision not in _reported:
        _reported.add(decision)
        logger.info("%s", on_rank(None, decision.describe()))
        if setting == "auto" and not decision.enabled:
            warnings.warn(
                on_rank(
                    None,
                    f"{decision.describe()}. Set MPIDIST_CUDA_AWARE=1 to skip the check on an "
                    "MPI you know is CUDA-aware.",
                ),
                RuntimeWarning,
                stacklevel=4,
            )
    return decision


def _self_test(comm: MPI.Intracomm, backend: Backend) -> bool:
    """Collective: one device-buffer allreduce compared against the host result."""
    xp = backend.xp
    probe = xp.full(1024, comm.rank + 1, dtype=xp.float64)
    backend.synchronize()
    try:
        comm.Allreduce(MPI.IN_PLACE, probe, MPI.SUM)
    except MPI.Exception:
        return False
    return bool((probe == comm.size * (comm.size + 1) / 2).all())
