"""Reduction algorithms, one class each behind one template, and the rule that picks one per call.

- :mod:`~mpidist._comm.algorithms.base`: :class:`Reduction`, the template
  (one-replica case, pieces) and the hooks an algorithm overrides;
- :mod:`~mpidist._comm.algorithms.flat`: :class:`Flat`, one ``MPI_Allreduce``;
- :mod:`~mpidist._comm.algorithms.hierarchical`: :class:`Hierarchical`,
  within the nodes, across their leaders, within the nodes again.

:class:`Algorithms` builds the algorithms a communicator may use and answers,
for each reduction, which one reduces it (:meth:`Algorithms.choose`), by the
rule of :func:`two_level_from`.
"""

from __future__ import annotations

from typing import Optional

from mpi4py import MPI

from mpidist._comm.algorithms.base import Reduction
from mpidist._comm.algorithms.flat import Flat
from mpidist._comm.algorithms.hierarchical import Hierarchical
from mpidist._comm.library import library_version
from mpidist._comm.topology import Topology
from mpidist._comm.transport import Transport

__all__ = ["TWO_LEVEL_FROM", "Algorithms", "Flat", "Hierarchical", "Reduction", "two_level_from"]

# The smallest reduction (bytes reduced by one call: a piece at most) that takes the two-level algorithm by default
# across nodes, under Open MPI: a whole piece of the default size. Measured with benchmarks/multinode.sh
# (docs/benchmarks.md, "Across nodes: shaped links"), links shaped to 1 Gbit/s: reductions of 16 MiB and more
# (in 2 MiB pieces) took 0.67-0.79x of Open MPI's flat allreduce's time two-level on 4 nodes x 2 ranks, and
# 0.80-0.95x at 9 of 10 sizes in two runs on 2 x 2; single calls of 1-2 MiB were faster flat in one of them. Under
# MPICH the flat allreduce was the faster from 1 MiB (its own algorithm already sends each byte about once over
# each link). Where the CPU rather than the link limits, the two-level one lost under both.
TWO_LEVEL_FROM = 2 << 20


def two_level_from(
    hierarchical: Optional[bool], num_nodes: int, size: int, piece_bytes: int, open_mpi: bool
) -> Optional[int]:
    """Local: the smallest reduction (bytes) that takes the two-level algorithm; ``None``: none does.

    ``hierarchical`` (the option): ``True`` every reduction, ``False`` none;
    ``None`` (auto): under Open MPI (``open_mpi``) from :data:`TWO_LEVEL_FROM`
    bytes, or from a whole piece where ``piece_bytes`` is smaller (so that every
    piece of a large reduction takes it), when the ``size`` ranks span
    ``num_nodes`` > 1 nodes and some node holds more than one of them; otherwise
    none (with one rank per node the stages within the nodes would reduce
    nothing; on one node there is nothing to save). Every input is the same on
    every rank (the options are agreed at creation, the number of nodes is a
    collective count, every rank runs the same library), and so is the answer.
    """
    if hierarchical is not None:
        return 0 if hierarchical else None
    if open_mpi and 1 < num_nodes < size:
        return min(TWO_LEVEL_FROM, piece_bytes)
    return None


class Algorithms:
    """The reduction algorithms of one communicator, and the rule that picks one for each call.

    Collective construction (the algorithms the options allow are built up
    front, some of them split communicators); :meth:`free` is collective.
    ``device_buffers``: whether MPI may be handed device memory (CUDA-aware
    MPI, agreed by every rank), so that a buffer may be one on some ranks.
    """

    def __init__(self, transport: Transport, topology: Topology, device_buffers: bool = False) -> None:
        self.flat = Flat(transport)
        options = transport.options
        threshold = two_level_from(
            options.hierarchical,
            topology.num_nodes,
            transport.size,
            options.piece_bytes,
            topology.num_nodes > 1 and library_version().startswith("Open MPI"),
        )
        # Compressed reductions (mpidist._comm.compression) take it wherever the ranks span nodes and some node
        # holds more than one (unless hierarchical=False): only its leaders' stage is compressed, so each node's sum
        # crosses the node's link once in 16 bits, where a flat exchange of 16-bit slices would send every rank's.
        compressed = (
            options.compression is not None
            and options.hierarchical is not False
            and 1 < topology.num_nodes < transport.size
        )
        # Built only where some reduction takes it: never on one node unless forced (hierarchical=True).
        built = threshold is not None or compressed
        self.hierarchical: Optional[Hierarchical] = Hierarchical(transport, topology, device_buffers) if built else None
        self._exact: Optional[Hierarchical] = None if threshold is None else self.hierarchical  # choose()'s
        self.two_level_from: int = threshold or 0

    def choose(self, nbytes: int) -> Reduction:
        """Local: the algorithm that reduces ``nbytes`` bytes, which every rank agreed on.

        The one rule, so every rank picks the same algorithm: two-level from
        :attr:`two_level_from` bytes where the algorithm was built
        (:func:`two_level_from`: from the options, the agreed number of nodes and
        ranks), flat otherwise. Without the two-level algorithm (one node, or
        ``hierarchical=False``) it is one attribute test.
        """
        hierarchical = self._exact
        if hierarchical is None or nbytes < self.two_level_from:
            return self.flat
        return hierarchical

    def communicators(self) -> list[MPI.Intracomm]:
        """Local: the communicators split for the algorithms (revoked with the private one when ranks die)."""
        return [] if self.hierarchical is None else self.hierarchical.communicators()

    def choose_compressed(self) -> Reduction:
        """Local: the algorithm of a compressed reduction (any size): the two-level one where it was built
        (``hierarchical=True``, or ranks across nodes: see ``__init__``), flat otherwise; every rank alike."""
        return self.flat if self.hierarchical is None else self.hierarchical

    def free(self) -> None:
        """Collective: release what the algorithms hold."""
        if self.hierarchical is not None:
            self.hierarchical.free()
