"""MPI library settings mpidist chooses where the user has not: Open MPI's nonblocking allreduce.

Open MPI's nonblocking allreduce (``coll/libnbc``), which mpidist's collectives
run on whenever a deadline is set and which its large reductions are pipelined
through, picks the binomial algorithm below 4 ranks, and for in-place reductions
at any size: there a 1-2 MiB reduction takes about 1.6x the blocking call. The
ring algorithm takes 0.8x (2 ranks) of it. Below 4 ranks mpidist chooses the ring
(``coll_libnbc_iallreduce_algorithm`` = 1); at 4 ranks and more, where the
ring's 2(N-1) steps cost more than they save for medium sizes, Open MPI's own
choice stays. The user's choice always stays: an
``OMPI_MCA_coll_libnbc_iallreduce_algorithm`` in the environment, or the MCA
parameter set to anything but its default elsewhere (a parameter file). MPICH has
no such variable and is left alone.

Two routes, one outcome:

- :func:`tune_before_init` (Local, at import): when mpidist is imported before
  ``mpi4py.MPI`` starts MPI, the choice goes into the environment, where
  ``MPI_Init`` reads it.
- :func:`tune_at_run_time` (Collective, at the first mpidist communicator over the
  whole MPI world): when MPI started first (``from mpi4py import MPI`` sorts before
  ``import mpidist``), the control variable is written through the MPI tool
  interface (MPI_T), on every rank or, should any rank fail, on none.

:func:`ring_setting` says which applied in this process; :func:`libnbc_iallreduce_algorithm`
reads the value in effect.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, Optional

import numpy as np

from mpidist._errors import on_rank

if TYPE_CHECKING:
    from mpidist._comm.transport import Transport

__all__ = ["RingSetting", "libnbc_iallreduce_algorithm", "ring_setting", "tune_at_run_time", "tune_before_init"]

logger = logging.getLogger("mpidist.comm")

_LIBNBC_ALLREDUCE = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
_CVAR = "coll_libnbc_iallreduce_algorithm"
_DEFAULT = 0  # "ignore": libnbc picks by size and count
_RING = 1
_RING_BELOW = 4  # ranks


@dataclasses.dataclass(frozen=True)
class RingSetting:
    """How Open MPI's nonblocking allreduce algorithm was settled in this process.

    ``how`` is one of ``"environment"`` (mpidist's choice, set before MPI started),
    ``"MPI_T"`` (mpidist's choice, set through the tool interface after MPI started),
    ``"user"`` (the user's choice stays), ``"not applicable"`` (not Open MPI, or 4 ranks
    and more), ``"failed"`` (the tool interface failed on some rank: Open MPI's own
    choice stays, or, where putting the default back failed too, the ring on this rank
    only, with a warning), ``"undecided"`` (no mpidist communicator over the whole world yet).
    ``detail`` says the same for people, with the values.
    """

    how: str
    detail: str

    @property
    def in_effect(self) -> bool:
        """Whether mpidist's ring choice is in effect."""
        return self.how in ("environment", "MPI_T")


_env_set = False  # tune_before_init put the ring into the environment
_settled: Optional[RingSetting] = None  # by tune_at_run_time, once per process


def tune_before_init() -> None:
    """Local: put the ring into ``os.environ`` unless MPI has started, 4 ranks or more run, or the user chose."""
    global _env_set
    if "mpi4py.MPI" in sys.modules:
        return  # too late: MPI reads these at initialisation; tune_at_run_time takes over
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", "")  # set by Open MPI's launcher in every rank
    if size.isdigit() and int(size) < _RING_BELOW and _LIBNBC_ALLREDUCE not in os.environ:
        os.environ[_LIBNBC_ALLREDUCE] = str(_RING)
        _env_set = True


def tune_at_run_time(transport: Transport) -> None:
    """Collective over ``transport.comm`` (a new private communicator): settle the algorithm once per process.

    Acts at the first communicator over the whole MPI world (the setting is per process,
    so every rank that runs collectives with these ranks must share it); later calls,
    and communicators over part of the world, return at once without communicating.
    Under Open MPI below 4 ranks it makes one small allgather through ``transport``
    (under its deadline; fewer than 4 ranks, once per process), so that the ring is set on every rank or on none: where
    another rank kept the user's choice or could not set it, the ranks that have the
    ring put the default back. A failure is logged at debug level and leaves Open
    MPI's choice; should putting the default back fail, the ranks disagree on the
    algorithm and a warning says how to settle it.
    """
    global _settled
    if _settled is not None:
        return
    from mpi4py import MPI

    from mpidist._comm.library import library_version, write_control_variable

    world = MPI.COMM_WORLD
    if not library_version().startswith("Open MPI"):
        _settled = RingSetting(
            "not applicable", f"the library's own choice ({library_version()}; mpidist chooses only under Open MPI)"
        )
        return
    if world.size >= _RING_BELOW:
        _settled = _users_choice() or RingSetting(
            "not applicable", f"Open MPI's own choice at {world.size} ranks (mpidist chooses the ring below 4)"
        )
        return
    if transport.comm.Compare(world) == MPI.UNEQUAL:
        return  # settled at a communicator over the whole world
    local = _settle_locally()
    # An allgather, not an allreduce: the nonblocking form (under a deadline) is not run by the
    # iallreduce algorithm the ranks may disagree on here
    transport.begin()
    everyone = np.empty(transport.size, dtype=np.int32)
    transport.run(
        "the choice of Open MPI's iallreduce algorithm", "Allgather", np.array([local.in_effect], np.int32), everyone
    )
    if not everyone.all() and local.in_effect:
        try:  # another rank kept the user's choice or could not set the ring: the same default everywhere
            write_control_variable(_CVAR, _DEFAULT)
            local = RingSetting("failed", "Open MPI's own choice: not every rank could set the ring")
        except Exception as exc:  # ctypes and MPI_T fail in many ways: the warning says so
            logger.debug("could not put %s back to %d through MPI_T: %s", _CVAR, _DEFAULT, exc)
            local = RingSetting("failed", f"the ring stays on this rank only: putting the default back failed ({exc})")
            warnings.warn(
                on_rank(
                    transport.rank,
                    f"could not put Open MPI's {_CVAR} back to its default ({exc}) after another rank "
                    "could not set the ring: the ranks now use different iallreduce algorithms. "
                    f"Set {_LIBNBC_ALLREDUCE} in the job's environment (e.g. to 0 or 1) to choose one for every rank",
                ),
                RuntimeWarning,
                stacklevel=2,
            )
    _settled = local


def _settle_locally() -> RingSetting:
    """This rank's outcome, writing the ring through MPI_T where it is due."""
    chosen = _users_choice()
    if chosen is not None:
        return chosen
    if _env_set:  # MPI_Init read it: in effect, whatever MPI_T could say
        return RingSetting("environment", "ring: set by mpidist in the environment before MPI started")
    from mpidist._comm.library import read_control_variable, write_control_variable

    try:
        current = read_control_variable(_CVAR)
        if current != _DEFAULT:
            return RingSetting("user", f"the user's choice: {_CVAR}={current} (an MCA parameter)")
        write_control_variable(_CVAR, _RING)
    except Exception as exc:  # ctypes, MPI_T: every rank must reach the agreement
        logger.debug("could not set %s to the ring (%d) through MPI_T: %s", _CVAR, _RING, exc)
        return RingSetting("failed", f"Open MPI's own choice: setting the ring through MPI_T failed ({exc})")
    return RingSetting("MPI_T", "ring: set by mpidist through MPI_T, MPI having started before mpidist was imported")


def _users_choice() -> Optional[RingSetting]:
    """The user's setting in the environment, if any (not the one :func:`tune_before_init` made)."""
    chosen = os.environ.get(_LIBNBC_ALLREDUCE)
    if chosen is None or (_env_set and chosen == str(_RING)):
        return None
    return RingSetting("user", f"the user's choice: {_LIBNBC_ALLREDUCE}={chosen}")


def ring_setting() -> RingSetting:
    """Local: how Open MPI's nonblocking allreduce algorithm was settled in this process (see :class:`RingSetting`)."""
    if _settled is not None:
        return _settled
    return RingSetting("undecided", "not settled yet: no mpidist communicator over the whole MPI world")


def libnbc_iallreduce_algorithm() -> Optional[int]:
    """Local: the value of Open MPI's ``coll_libnbc_iallreduce_algorithm`` now (1: ring, 0: Open MPI chooses).

    ``None`` under another MPI library (never asked) or when the tool interface fails.
    """
    from mpidist._comm.library import library_version, read_control_variable

    if not library_version().startswith("Open MPI"):
        return None
    try:
        return read_control_variable(_CVAR)
    except OSError as exc:
        logger.debug("could not read %s through MPI_T: %s", _CVAR, exc)
        return None
