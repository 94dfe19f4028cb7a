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

A blocking reduction of many pieces (:meth:`Hierarchical.reduce_pieces`) runs
the three stages as a pipeline, so that the link never waits for the stages
within the nodes: while some pieces cross between the nodes, later ones are
reduced onto the leaders and earlier ones broadcast back. Up to
:data:`IN_FLIGHT` pieces cross at once. Between two leaders they cross as one
message each way, both ways at once, each leader combining the other's piece
with its own in the same order (between two nodes of two ranks, Open MPI's
nonblocking allreduce of the two leaders carried half the link where these
messages carried all of it: ``docs/benchmarks.md``); between more leaders, or
where MPI may be handed device memory (CUDA-aware MPI), each piece is a
nonblocking allreduce among the leaders. Every rank of a node starts the
node's collectives in one fixed order, whatever completes first.

The nonblocking form is the flat one (one ``MPI_Iallreduce`` per piece, all
started at once). The stages of the two-level reduction depend on each other,
so a nonblocking two-level reduction would have to start its later stages
when the first completed: collective calls made by whichever call completes
the handle (``wait()``, or ``free()`` and the exit for a handle never waited),
in an order that the ranks need not share. Completing a handle makes no
collective call, whatever the algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional, cast

import numpy as np
from mpi4py import MPI

from mpidist._comm.algorithms.flat import Flat
from mpidist._comm.topology import Topology, group_split
from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["IN_FLIGHT", "Hierarchical"]

# Pieces crossing between the nodes at once in a pipelined reduction (32 MiB of default pieces). Measured between
# two nodes of 1 Gbit/s links (benchmarks/multinode.sh): eight 2 MiB exchanges in flight carried 0.95 Gbit/s each
# way, two 0.70, one at a time 0.49-0.52 (each message waits a round trip behind the queue of the link). With two
# ranks per node the pipeline carried 0.71-0.74 Gbit/s at 32-64 MiB with 8 in flight, 0.80-0.83 with 16.
IN_FLIGHT = 16
_TAG_PIECE = 7710  # the leaders' point-to-point messages (their own communicator carries nothing else)


class Hierarchical(Flat):
    """Reduce to the node leader, allreduce among the leaders, broadcast within the node.

    Blocking reductions take the three stages (a buffer's pieces as a
    pipeline); nonblocking ones are the flat algorithm's (inherited: see the
    module's docstring for why). Collective construction over the transport's
    communicator (it splits the leaders' communicator, and the nodes when
    ``options.node_size`` is set); :meth:`free` (collective) releases what it
    split. ``device_buffers``: whether MPI may be handed device memory (agreed
    by every rank), where the pieces cross as allreduces.
    """

    pipelined = True

    def __init__(self, transport: Transport, topology: Topology, device_buffers: bool = False) -> None:
        super().__init__(transport)
        # where MPI may be handed device memory, pieces cross as allreduces: a piece may be in device memory on one
        # leader and on the host on the other, and both must make the same calls (device_buffers is agreed)
        self._pairs = not device_buffers
        comm, node_size = transport.comm, transport.options.node_size
        self._own_node = bool(node_size)
        self.node: MPI.Intracomm = group_split(comm, node_size) if node_size else topology.node
        self.is_leader = self.node.rank == 0
        # COMM_NULL on the other ranks
        self.leaders = cast(MPI.Intracomm, comm.Split(0 if self.is_leader else MPI.UNDEFINED, comm.rank))
        self._spare: dict[np.dtype, np.ndarray] = {}  # where the other leader's pieces arrive (_slots)

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

        self.stages(what, [buffer], mpi_op, across)

    def reduce_pieces(
        self, what: str, pieces: Sequence[Array], mpi_op: MPI.Op, reduced: Optional[Callable[[int], None]] = None
    ) -> None:
        """Collective: the three stages, pipelined over ``pieces`` (see the module's docstring).

        Step ``s`` starts the reduction of piece ``s`` onto the node leader
        (and, between two leaders, the receipt of the other's piece ``s``);
        completes the reduction of piece ``s - 1``, whose crossing the leader
        then starts; completes the crossing of piece ``s - 1 - IN_FLIGHT``,
        whose broadcast within the node every rank then starts; and completes
        the broadcast of the piece before that one, calling ``reduced``. The
        node's collectives thus start in the same order on each of its ranks,
        and no two stages use a piece's buffer at once.
        """
        if self.size == 1:
            return super().reduce_pieces(what, pieces, mpi_op, reduced)
        t, node, n, leader = self.transport, self.node, len(pieces), self.is_leader
        crossing = leader and self.leaders.size > 1
        pair = crossing and self.leaders.size == 2 and n > 0 and self._pairs
        slots = self._slots(pieces[0], n) if pair else None
        other = 1 - self.leaders.rank if slots is not None else -1
        up: list[MPI.Request] = []
        over: list[list[MPI.Request]] = []
        down: list[MPI.Request] = []
        try:
            for s in range(n + IN_FLIGHT + 2):
                if s < n:
                    if slots is not None:  # the other leader's piece may come before this one is ready
                        slot = slots[s % len(slots), : pieces[s].size]
                        over.append([t.call(what, self.leaders.Irecv, slot, other, _TAG_PIECE)])
                    send, recv = (MPI.IN_PLACE, pieces[s]) if leader else (pieces[s], None)
                    up.append(t.start("Reduce", send, recv, mpi_op, 0, comm=node))
                j = s - 1
                if 0 <= j < n:
                    t.wait([up[j]], what)
                    if slots is not None:
                        over[j].append(t.call(what, self.leaders.Isend, pieces[j], other, _TAG_PIECE))
                    elif crossing:
                        over.append([t.start("Allreduce", MPI.IN_PLACE, pieces[j], mpi_op, comm=self.leaders)])
                i = j - IN_FLIGHT
                if 0 <= i < n:
                    if crossing:
                        t.wait(over[i], what)
                        if slots is not None:
                            self._combine(what, pieces[i], slots[i % len(slots), : pieces[i].size], mpi_op)
                    down.append(t.start("Bcast", pieces[i], 0, comm=node))
                h = i - 1
                if 0 <= h < n:
                    t.wait([down[h]], what)
                    if reduced is not None:
                        reduced(h)
        except BaseException:  # MPI may still read or write the buffers of the requests in flight: keep them
            t.stranded += [r for r in (*up, *(r for rs in over for r in rs), *down) if r]
            raise

    def _slots(self, piece: Array, n: int) -> np.ndarray:
        """Local: where the other leader's pieces like ``piece`` arrive, of a call of ``n`` pieces: one row per
        piece in flight (reused from call to call, grown when too small)."""
        rows = min(n, IN_FLIGHT + 2)  # the pieces crossing, and the next, whose receipt starts before one completes
        slots = self._spare.get(piece.dtype)
        if slots is None or slots.shape[0] < rows or slots.shape[1] < piece.size:
            shape = (max(rows, 0 if slots is None else slots.shape[0]), piece.size)
            slots = self._spare[piece.dtype] = np.empty(shape, dtype=piece.dtype)
        return slots[:rows]

    def _combine(self, what: str, piece: Array, theirs: np.ndarray, mpi_op: MPI.Op) -> None:
        """Local, once a piece crossed: ``piece`` <- leader 0's piece ``mpi_op`` leader 1's, alike on both
        leaders (the same operands in the same places: bit for bit, NaN and signed zeros included)."""
        call = self.transport.call
        if self.leaders.rank == 0:
            call(what, mpi_op.Reduce_local, piece, theirs)
            piece[...] = theirs
        else:
            call(what, mpi_op.Reduce_local, theirs, piece)

    def stages(
        self,
        what: str,
        pieces: Sequence[Array],
        mpi_op: MPI.Op,
        across: Callable[[MPI.Intracomm], None],
        landed: Optional[Callable[[int], None]] = None,
    ) -> None:
        """Collective: each of ``pieces`` (of one buffer) reduced by ``mpi_op`` onto the node leader, then
        ``across(leaders)`` once on the leaders (the leaders' communicator, of one rank on one node), then each
        piece broadcast within the node, ``landed(k)`` (local) running once piece ``k`` did.

        The stage across the nodes is the caller's: an allreduce for :meth:`reduce`, a compressed
        exchange for :mod:`~mpidist._comm.compression`. The stages within the nodes take a piece at a time:
        a buffer of many pieces in one call took Open MPI's nonblocking reduce and broadcast (those the
        deadline polls) 13x the time between two nodes of two ranks.
        """
        run, node = self.transport.run, self.node
        for piece in pieces:
            if self.is_leader:
                run(what, "Reduce", MPI.IN_PLACE, piece, mpi_op, 0, comm=node)
            else:
                run(what, "Reduce", piece, None, mpi_op, 0, comm=node)
        if self.is_leader:
            across(self.leaders)
        for k, piece in enumerate(pieces):
            run(what, "Bcast", piece, 0, comm=node)
            if landed is not None:
                landed(k)
