"""Reduction algorithms, one class each behind one template, and the rule that picks one per call.

- :mod:`~mpidist._comm.algorithms.base`: :class:`Reduction`, the template
  (one-replica case, pieces) and the hooks an algorithm overrides;
- :mod:`~mpidist._comm.algorithms.flat`: :class:`Flat`, one ``MPI_Allreduce``;
- :mod:`~mpidist._comm.algorithms.hierarchical`: :class:`Hierarchical`,
  within the nodes, across their leaders, within the nodes again.

:class:`Algorithms` builds the algorithms a communicator may use and answers,
for each reduction, which one reduces it (:meth:`Algorithms.choose`).
"""

from __future__ import annotations

from typing import Optional

from mpidist._comm.algorithms.base import Reduction
from mpidist._comm.algorithms.flat import Flat
from mpidist._comm.algorithms.hierarchical import Hierarchical
from mpidist._comm.topology import Topology
from mpidist._comm.transport import Transport

__all__ = ["Algorithms", "Flat", "Hierarchical", "Reduction"]


class Algorithms:
    """The reduction algorithms of one communicator, and the rule that picks one for each call.

    Collective construction (the algorithms the options allow are built up
    front, some of them split communicators); :meth:`free` is collective.
    """

    def __init__(self, transport: Transport, topology: Topology) -> None:
        self.flat = Flat(transport)
        self.hierarchical: Optional[Hierarchical] = (
            Hierarchical(transport, topology) if transport.options.hierarchical else None
        )

    def choose(self, nbytes: int) -> Reduction:
        """Local: the algorithm that reduces ``nbytes`` bytes, which every rank agreed on.

        The one rule, so every rank picks the same algorithm: today it depends on the
        options only (two-level with ``options.hierarchical``, flat otherwise). The
        size, and the topology this object was built with, are its inputs so that a
        later rule can use them, alike on every rank.
        """
        hierarchical = self.hierarchical
        return self.flat if hierarchical is None else hierarchical

    def free(self) -> None:
        """Collective: release what the algorithms hold."""
        if self.hierarchical is not None:
            self.hierarchical.free()
