"""The two-level (hierarchical) reduction: within each node, across node leaders, within each node.

On a multi-node run most of a flat allreduce's traffic can stay inside the
nodes: the ranks of a node first reduce onto their node leader over a
shared-memory communicator, the leaders allreduce among themselves (one rank
per node on the network), and each leader broadcasts the result back within its
node. The result equals the flat algorithm's up to the order in which floating
point numbers are added (exactly, for integers).

``options.node_size`` forces the grouping (every ``node_size`` consecutive
ranks form a "node", :func:`~mpidist._comm.topology.group_split`), so the
algorithm can be tried and tested on one machine; otherwise the nodes are the
:class:`~mpidist._comm.topology.Topology`'s.

The nonblocking form is the flat one (one ``MPI_Iallreduce`` per piece, all
started at once). The stages of the two-level reduction depend on each other,
so a nonblocking two-level reduction would have to start its later stages
when the first completed: collective calls made by whichever call completes
the handle (``wait()``, or ``free()`` and the exit for a handle never waited),
in an order that the ranks need not share. Completing a handle makes no
collective call, whatever the algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, cast

from mpi4py import MPI

from mpidist._comm.algorithms.flat import Flat
from mpidist._comm.topology import Topology, group_split
from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Hierarchical"]


class Hierarchical(Flat):
    """Reduce to the node leader, allreduce among the leaders, broadcast within the node.

    Blocking reductions take the three stages; nonblocking ones are the flat
    algorithm's (inherited: see the module's docstring for why). Collective
    construction over the transport's communicator (it splits the leaders'
    communicator, and the nodes when ``options.node_size`` is set);
    :meth:`free` (collective) releases what it split.
    """

    def __init__(self, transport: Transport, topology: Topology) -> None:
        super().__init__(transport)
        comm, node_size = transport.comm, transport.options.node_size
        self._own_node = bool(node_size)
        self.node: MPI.Intracomm = group_split(comm, node_size) if node_size else topology.node
        self.is_leader = self.node.rank == 0
        # COMM_NULL on the other ranks
        self.leaders = cast(MPI.Intracomm, comm.Split(0 if self.is_leader else MPI.UNDEFINED, comm.rank))

    def communicators(self) -> list[MPI.Intracomm]:
        """Local: the communicators this algorithm runs on (the node's and the leaders'; COMM_NULL off a leader)."""
        return [self.node, self.leaders]

    def free(self) -> None:
        """Collective: release the leaders' communicator (and the nodes', when split by ``node_size``)."""
        for c in (self.leaders, self.node) if self._own_node else (self.leaders,):
            if c != MPI.COMM_NULL:
                c.Free()

    def reduce_implementation(self, what: str, buffer: Array, mpi_op: MPI.Op) -> None:
        """Collective: the three stages, blocking: onto the node leader, among the leaders, within the node."""

        def across(leaders: MPI.Intracomm) -> None:
            if leaders.size > 1:
                self.transport.run(what, "Allreduce", MPI.IN_PLACE, buffer, mpi_op, comm=leaders)

        self.stages(what, buffer, mpi_op, across)

    def stages(self, what: str, buffer: Array, mpi_op: MPI.Op, across: Callable[[MPI.Intracomm], None]) -> None:
        """Collective: ``buffer`` reduced by ``mpi_op`` onto the node leader, then ``across(leaders)`` on the
        leaders (the leaders' communicator, of one rank on one node), then broadcast within the node.

        The stage across the nodes is the caller's: an allreduce for :meth:`reduce`, a compressed
        exchange for :mod:`~mpidist._comm.compression`.
        """
        run = self.transport.run
        if self.is_leader:
            run(what, "Reduce", MPI.IN_PLACE, buffer, mpi_op, 0, comm=self.node)
            across(self.leaders)
        else:
            run(what, "Reduce", buffer, None, mpi_op, 0, comm=self.node)
        run(what, "Bcast", buffer, 0, comm=self.node)
