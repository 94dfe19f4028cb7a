"""The flat reduction: one ``MPI_Allreduce`` over every rank; the MPI library picks how.

The default algorithm, and the fastest on one node: the library's own
allreduce (ring, recursive doubling, shared-memory) is tuned for its transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from mpi4py import MPI

from mpidist._comm.algorithms.base import Completion, Piece, Reduction, nothing

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Flat"]


class Flat(Reduction):
    """``MPI_Allreduce`` on the transport's communicator (``MPI_Iallreduce`` per piece). Local construction."""

    def reduce_implementation(self, what: str, send: Optional[Array], recv: Array, mpi_op: MPI.Op) -> None:
        """Collective: one allreduce, in place when ``send`` is ``None``."""
        self.transport.run(what, "Allreduce", MPI.IN_PLACE if send is None else send, recv, mpi_op)

    def start_implementation(
        self, what: str, pieces: Sequence[Piece], mpi_op: MPI.Op
    ) -> tuple[list[MPI.Request], Completion]:
        """Collective: one nonblocking allreduce per piece; nothing to complete after them."""
        start = self.transport.start
        return [start("Allreduce", MPI.IN_PLACE if s is None else s, r, mpi_op) for s, r in pieces], nothing
