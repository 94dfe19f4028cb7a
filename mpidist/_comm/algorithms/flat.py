"""The flat reduction: one ``MPI_Allreduce`` over every rank; the MPI library picks how.

The default algorithm, and the fastest on one node: the library's own
allreduce (ring, recursive doubling, shared-memory) is tuned for its transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mpi4py import MPI

from mpidist._comm.algorithms.base import Completion, Reduction, nothing

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Flat"]


class Flat(Reduction):
    """``MPI_Allreduce`` on the transport's communicator (``MPI_Iallreduce`` per piece). Local construction."""

    def reduce_implementation(self, what: str, buffer: Array, mpi_op: MPI.Op) -> None:
        """Collective: one allreduce, in place."""
        self.transport.run(what, "Allreduce", MPI.IN_PLACE, buffer, mpi_op)

    def start_implementation(
        self, what: str, buffers: Sequence[Array], mpi_op: MPI.Op
    ) -> tuple[list[MPI.Request], Completion]:
        """Collective: one nonblocking allreduce per piece, in place; nothing to complete after them."""
        start = self.transport.start
        return [start("Allreduce", MPI.IN_PLACE, buffer, mpi_op) for buffer in buffers], nothing
