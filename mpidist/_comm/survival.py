"""Surviving dead ranks: how the survivors of a communicator learn of a failure and agree on what is left.

The MPI half of fault tolerance (``options.fault_tolerance``), on MPI
libraries with the User-Level Failure Mitigation interface (Open MPI 5 under
``mpiexec --with-ft ulfm``). When a rank dies, the MPI calls of the ranks that
depended on it fail with ``MPI_ERR_PROC_FAILED``; :func:`is_peer_failure`
tells those errors (and ``MPI_ERR_REVOKED``, which the other ranks then get)
from the rest. A survivor that sees one revokes the communicator (every
survivor's pending and next call on it fails at once, wherever it waits),
then all survivors :func:`shrink` it together: ``MPI_Comm_shrink`` agrees on
the failed processes and builds a communicator of the survivors, the same
on every one of them, in their old order. On that communicator the survivors
exchange how far each got (:func:`progress`): which collective each was in,
so that they can tell a call that completed on some of them from one that
completed nowhere, and how many input steps each drew.

Everything here is collective over the survivors and never waits for a dead
rank: ``MPI_Comm_shrink`` and the exchange on its result complete without
them, and a further failure while they run starts the shrink again from the
communicator it left. What hangs off a communicator (the agreement's
persistent request, the node and leader communicators) is rebuilt by its
owner, the :class:`~mpidist.Communicator`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional, cast

import numpy as np
from mpi4py import MPI

__all__ = [
    "Progress",
    "failed_ranks",
    "is_peer_failure",
    "known_failed",
    "progress",
    "readiness",
    "release",
    "revoke",
    "shrink",
]

# The error classes of ULFM that mean "a process of this communicator failed" (or another survivor revoked it
# because one did). MPI libraries without ULFM (MPICH's mpi4py) spell them as MPI_ERR_UNKNOWN: not counted.
_PEER_FAILED = frozenset(
    c
    for c in (getattr(MPI, n, MPI.ERR_UNKNOWN) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED"))
    if c != MPI.ERR_UNKNOWN
)
_SHRINK_TRIES = 8  # further failures while the survivors shrink: each one starts the shrink again


def readiness(env: Optional[Mapping[str, str]] = None) -> tuple[bool, str]:
    """Local: whether the survivors of a dead rank can carry on in this job, and in words why (or what to do).

    Open MPI can when its launcher was started with ``--with-ft ulfm`` (which
    sets ``OMPI_MCA_mpi_ft_enable`` in the ranks' environment); MPICH cannot.
    Whether ULFM's failure detector (``OMPI_MCA_mpi_ft_detector``) is on says
    how a node cut off by its network is noticed.
    """
    env = os.environ if env is None else env
    if not _PEER_FAILED or not hasattr(MPI.Comm, "Shrink"):
        return False, "end the job: this MPI library has no ULFM, its launcher ends the job when a rank dies"
    if _on(env, "OMPI_MCA_mpi_ft_enable"):
        if _on(env, "OMPI_MCA_mpi_ft_detector"):
            timeout = env.get("OMPI_MCA_mpi_ft_detector_timeout", "").strip() or "10"
            cut = f"ULFM's failure detector is on (timeout {timeout} s): a node cut off is noticed in a few timeouts"
        else:
            cut = "ULFM's failure detector is off: a node cut off by its network is noticed at the timeout"
        return True, f"the survivors can carry on: Open MPI with ULFM, started with --with-ft ulfm; {cut}"
    return False, (
        "end the job: start it with mpiexec --with-ft ulfm (MPIDIST_FAULT_TOLERANCE=1 bash jobs/mpirun.sh ...) "
        "to let the survivors carry on"
    )


def _on(env: Mapping[str, str], name: str) -> bool:
    """Local: whether the MCA variable ``name`` is set true in ``env``."""
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on", "t", "y", "enabled")


def is_peer_failure(exc: MPI.Exception) -> bool:
    """Local: whether MPI's ``exc`` says that a process of the communicator failed, or that a survivor revoked it."""
    try:
        return exc.Get_error_class() in _PEER_FAILED
    except MPI.Exception:
        return False


def revoke(comm: MPI.Comm) -> None:
    """Local: revoke ``comm`` (every rank's pending and later calls on it fail), where the library can."""
    if comm == MPI.COMM_NULL:
        return
    try:
        comm.Revoke()
    except (MPI.Exception, NotImplementedError):
        pass


def release(comm: MPI.Comm) -> None:
    """Local: free a communicator that ranks' deaths made useless (its free may fail: nothing to do then)."""
    try:
        comm.Free()
    except MPI.Exception:
        pass


def known_failed(comm: MPI.Comm) -> list[int]:
    """Local (error path): the ranks of ``comm`` this rank knows to have failed (what ULFM told it so far)."""
    try:
        group = comm.Get_failed()
        try:
            found = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), comm.Get_group())
        finally:
            group.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []
    return sorted(r for r in found if r != MPI.UNDEFINED)


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Collective over the survivors of ``comm`` (which the caller revoked): a communicator of the survivors.

    The same communicator on every survivor, its ranks in their order in
    ``comm``. Retried on a further failure during the shrink itself.
    """
    error: Optional[MPI.Exception] = None
    for _ in range(_SHRINK_TRIES):
        try:
            return cast(MPI.Intracomm, comm.Shrink())
        except MPI.Exception as exc:
            error = exc
    assert error is not None
    raise error


def failed_ranks(before: MPI.Group, after: MPI.Intracomm) -> list[int]:
    """Local: the ranks of group ``before`` that are not in communicator ``after`` (the dead, in ``before``'s
    numbering)."""
    group = after.Get_group()
    try:
        kept = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), before)
    finally:
        group.Free()
    alive = set(kept)
    return [r for r in range(before.Get_size()) if r not in alive]


class Progress:
    """How far each survivor got when the failure stopped it: the same on every survivor. Local object.

    ``seq[r]`` is the number of the collective survivor ``r`` (in the new
    numbering) was in; ``input_steps[r]`` the steps it had drawn from mpidist's
    input iterators. A survivor whose number is the highest completed every
    collective before it; the others failed in the one before (a collective
    that completed on some survivors and not on others).
    """

    def __init__(self, seq: list[int], input_steps: list[int]) -> None:
        self.seq = seq
        self.input_steps = input_steps

    @property
    def ahead(self) -> list[int]:
        """The survivors (new ranks) that got furthest: those whose collective in progress was the latest."""
        top = max(self.seq)
        return [r for r, s in enumerate(self.seq) if s == top]

    @property
    def split(self) -> bool:
        """Whether a collective completed on some survivors and failed on others."""
        return min(self.seq) != max(self.seq)


def progress(comm: MPI.Intracomm, seq: int, input_steps: int) -> Progress:
    """Collective over ``comm`` (the survivors): every survivor's collective in progress and input steps drawn."""
    mine = np.array([seq, input_steps], dtype=np.int64)
    every = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(mine, every)
    return Progress(every[:, 0].tolist(), every[:, 1].tolist())
