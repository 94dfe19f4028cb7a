"""Where the ranks run: which ranks share a node, and how many nodes there are.

The one place that splits a communicator by node. The
:class:`~mpidist.Communicator` takes its node-local rank (and so its GPU) from
:class:`Topology`, and the two-level reduction
(:mod:`~mpidist._comm.algorithms.hierarchical`) its node groups.
:class:`Topology` always splits by shared memory; ``options.node_size`` (groups
of that many consecutive ranks, so that node-aware code can be tried on one
machine) is applied by its users with :func:`group_split`: the two-level
reduction and :meth:`~mpidist.Communicator.node`.
"""

from __future__ import annotations

import os
from typing import cast

from mpi4py import MPI

__all__ = ["Topology", "group_split", "node_split"]


def node_split(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Collective: the ranks of ``comm`` that share this node, for node-local rank and GPU binding.

    MPI's shared-memory split; should the library refuse it, a split by host name ordered by
    ``SLURM_LOCALID`` (Slurm's node-local task id) where set. Never consults the world size
    in ``SLURM_*`` variables, which some launchers leave wrong.
    """
    try:
        return cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank))
    except MPI.Exception:
        pass
    host = MPI.Get_processor_name()
    local_id = os.environ.get("SLURM_LOCALID", "")
    key = int(local_id) if local_id.isdigit() else comm.rank
    return cast(MPI.Intracomm, comm.Split(comm.allgather(host).index(host), key))


def group_split(comm: MPI.Intracomm, node_size: int) -> MPI.Intracomm:
    """Collective: every ``node_size`` consecutive ranks of ``comm`` as one "node" (a new communicator)."""
    return cast(MPI.Intracomm, comm.Split(comm.rank // node_size, comm.rank))


class Topology:
    """The node of this rank within ``comm`` (shared memory), and how many nodes ``comm`` spans.

    Collective construction; :meth:`free` (collective) releases :attr:`node`.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.node: MPI.Intracomm = node_split(comm)
        self.num_nodes: int = comm.allreduce(int(self.node.rank == 0))

    def free(self) -> None:
        """Collective: release the node communicator."""
        if self.node != MPI.COMM_NULL:
            self.node.Free()
