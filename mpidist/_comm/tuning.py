"""MPI library settings mpidist chooses before MPI starts, where the user has not chosen. Local.

Only settings that must be in place before ``MPI_Init`` live here; they take
effect when mpidist is imported before ``mpi4py.MPI`` (importing mpidist first
is enough: it imports mpi4py itself). A value already in the environment is
never changed.

- Open MPI's nonblocking allreduce (``coll/libnbc``), which mpidist's
  collectives run on whenever a deadline is set, picks the binomial
  algorithm below 4 ranks, and for in-place reductions at any size: there a
  1-2 MiB reduction takes about 1.6x the blocking call. The ring algorithm
  takes 0.8x (2 ranks) of it. Below 4 ranks the ring is chosen
  (``OMPI_MCA_coll_libnbc_iallreduce_algorithm=1``); at 4 ranks and more,
  where the ring's 2(N-1) steps cost more than they save for medium sizes,
  Open MPI's own choice stays.
"""

from __future__ import annotations

import os
import sys

__all__ = ["tune_before_init"]

_LIBNBC_ALLREDUCE = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
_RING = "1"
_RING_BELOW = 4  # ranks


def tune_before_init() -> None:
    """Set the defaults above in ``os.environ`` unless MPI has started or the user set them."""
    if "mpi4py.MPI" in sys.modules:
        return  # too late: MPI reads these at initialisation
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", "")  # set by Open MPI's launcher in every rank
    if size.isdigit() and int(size) < _RING_BELOW:
        os.environ.setdefault(_LIBNBC_ALLREDUCE, _RING)
