"""Two-level (hierarchical) reductions: within each node, across node leaders, within each node.

On a multi-node run most of a flat allreduce's traffic can stay inside the
nodes: the ranks of a node first reduce onto their node leader over a
shared-memory communicator, the leaders allreduce among themselves (one rank
per node on the network), and each leader broadcasts the result back within its
node. The result equals the flat algorithm's up to the order in which floating
point numbers are added (exactly, for integers).

``node_size`` forces the grouping (every ``node_size`` consecutive ranks form a
"node"), so the algorithm can be tried and tested on one machine. Part of the
comm layer: the :class:`~mpidist._comm.transport.Transport` runs it; :func:`node_split` is the
node-local grouping behind the communicator's local rank and GPU binding.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

if TYPE_CHECKING:
    from mpidist._comm.transport import Transport

__all__ = ["Hierarchy", "node_split"]


def node_split(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Collective: the ranks of ``comm`` that share this node, for node-local rank and GPU binding.

    MPI's shared-memory split; should the library refuse it, a split by host name ordered by
    ``SLURM_LOCALID`` (Slurm's node-local task id) where set. Never consults the world size
    in ``SLURM_*`` variables, which some launchers leave wrong.
    """
    try:
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    except MPI.Exception:
        pass
    host = MPI.Get_processor_name()
    local_id = os.environ.get("SLURM_LOCALID", "")
    key = int(local_id) if local_id.isdigit() else comm.rank
    return comm.Split(comm.allgather(host).index(host), key)


class Hierarchy:
    """The node and node-leader communicators of a communicator.

    Collective construction over ``comm``; :meth:`free` (collective) releases them.

    Args:
        comm: the communicator whose ranks are grouped.
        node_size: ranks per node; 0 groups the ranks that share memory.
    """

    def __init__(self, comm: MPI.Intracomm, node_size: int = 0) -> None:
        if node_size:
            self.node = comm.Split(comm.rank // node_size, comm.rank)
        else:
            self.node = node_split(comm)
        self.is_leader = self.node.rank == 0
        self.leaders = comm.Split(0 if self.is_leader else MPI.UNDEFINED, comm.rank)
        self.num_nodes: int = comm.allreduce(int(self.is_leader))

    def free(self) -> None:
        """Collective: release the node and leader communicators."""
        for c in (self.leaders, self.node):
            if c != MPI.COMM_NULL:
                c.Free()

    def allreduce(self, transport: "Transport", what: str, send: Any, recv: Any, op: MPI.Op) -> None:
        """Collective over ``transport``: ``recv`` <- the reduction of every rank's ``send`` (``recv`` if ``None``)."""
        self._reduce_to_leader(transport, what, send, recv, op, blocking=True)
        self.complete(transport, what, recv, op)

    def start(self, transport: "Transport", send: Any, recv: Any, op: MPI.Op) -> MPI.Request:
        """Collective, nonblocking first stage (the reduction within the node); finish with :meth:`complete`."""
        return self._reduce_to_leader(transport, "", send, recv, op, blocking=False)

    def complete(self, transport: "Transport", what: str, recv: Any, op: MPI.Op) -> None:
        """Collective: the leaders' allreduce of ``recv``, then the broadcast within each node (blocking)."""
        if self.is_leader and self.leaders.size > 1:
            transport.run(what, "Allreduce", MPI.IN_PLACE, recv, op, comm=self.leaders)
        transport.run(what, "Bcast", recv, 0, comm=self.node)

    def _reduce_to_leader(self, transport: "Transport", what: str, send: Any, recv: Any, op: MPI.Op,
                          blocking: bool) -> Any:
        if self.is_leader:
            args = (MPI.IN_PLACE if send is None else send, recv, op, 0)
        else:
            args = (recv if send is None else send, None, op, 0)
        if blocking:
            return transport.run(what, "Reduce", *args, comm=self.node)
        return transport.start("Reduce", *args, comm=self.node)
