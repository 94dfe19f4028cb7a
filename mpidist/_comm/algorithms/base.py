"""The template of every reduction algorithm: what all of them share, written once.

Modelled on TensorFlow's ``CrossDeviceOps`` (``cross_device_ops.py``): the
public methods of :class:`Reduction` take MPI-ready buffers, handle the
one-replica case (a copy, no MPI) once for every algorithm, and otherwise call
the hooks an algorithm overrides:

- :meth:`Reduction.reduce_implementation`: blocking, one buffer reduced in place;
- :meth:`Reduction.reduce_pieces`: blocking, the pieces of one buffer, each
  reduced in place (by default one ``reduce`` after the other; an algorithm
  whose stages can overlap from piece to piece overrides it);
- :meth:`Reduction.start_implementation`: nonblocking, the pieces of a
  pipelined reduction (each reduced in place), returning their requests and
  the local step that completes them once the requests did (it makes no MPI
  call).

Every reduction is in place: the output form never changes the MPI calls.
MPI requires ``MPI_IN_PLACE`` on every rank of a reduction or on none, and
whether a program passes a separate input (a new array, ``out=``) or reduces
in place is its own choice on each rank. So the callers copy a separate input
into the output first (on a device before
:meth:`~mpidist._comm.backend.Backend.to_mpi`, which synchronises its stream)
and hand the output over.

A piece is a cache-sized slice of one array reduced by its own MPI call
(``options.piece_bytes``, :meth:`Reduction.pieces`). A wire encoding (such as
a later compression) belongs to this template, as a stage around the hook, so
that every algorithm can use it. The layers above choose the algorithm for a
call with :meth:`~mpidist._comm.algorithms.Algorithms.choose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

from mpi4py import MPI

from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Completion", "Reduction", "nothing"]

Completion = Callable[[], None]


def nothing() -> None:
    """The completion step of pieces that need none."""


class Reduction:
    """A reduction algorithm over ``transport``: each buffer <- the elementwise reduction of every rank's, in place.

    Local construction unless a subclass says otherwise; :meth:`free` releases
    what the algorithm holds (collective). Buffers are MPI-ready (host
    memory, or device memory with CUDA-aware MPI, its stream synchronised).
    """

    pipelined = False  # whether reduce_pieces overlaps the pieces' stages (worth handing it every piece at once)

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.size = transport.size
        self.piece_bytes = transport.options.piece_bytes

    def free(self) -> None:
        """Collective: release the algorithm's communicators (none by default)."""

    def pieces(self, array: Array) -> list[tuple[int, int]]:
        """Local: ``(lo, hi)`` element ranges of ``options.piece_bytes`` covering the flat ``array``."""
        step = max(1, self.piece_bytes // max(1, array.itemsize))
        return [(lo, min(lo + step, array.size)) for lo in range(0, array.size, step)]

    def reduce(self, what: str, buffer: Array, mpi_op: MPI.Op) -> None:
        """Collective: ``buffer`` <- the reduction of every rank's ``buffer``, in place."""
        if self.size > 1:
            self.reduce_implementation(what, buffer, mpi_op)

    def reduce_pieces(
        self, what: str, pieces: Sequence[Array], mpi_op: MPI.Op, reduced: Optional[Callable[[int], None]] = None
    ) -> None:
        """Collective: reduce each of ``pieces`` (the pieces of one buffer) in place, blocking.

        ``reduced(k)`` (local) runs once piece ``k`` holds its result, in the
        pieces' order, while it is likely in cache. By default one
        :meth:`reduce` after the other; an algorithm whose stages can overlap
        across pieces overrides it.
        """
        for k, piece in enumerate(pieces):
            self.reduce(what, piece, mpi_op)
            if reduced is not None:
                reduced(k)

    def start(self, what: str, buffers: Sequence[Array], mpi_op: MPI.Op) -> tuple[list[MPI.Request], Completion]:
        """Collective, nonblocking: start reducing each of ``buffers`` (the pieces of a reduction) in place.

        Returns the requests and the step to run once they completed, which
        is local: completing a nonblocking collective makes no further MPI
        call, so that handles may complete in any order, and at ``free()`` or
        exit.
        """
        if self.size == 1:
            return [], nothing
        return self.start_implementation(what, buffers, mpi_op)

    # -- what an algorithm overrides ---------------------------------------------------------
    def reduce_implementation(self, what: str, buffer: Array, mpi_op: MPI.Op) -> None:
        """Collective, at two ranks or more: reduce ``buffer`` in place over every rank (:meth:`reduce`'s work)."""
        raise NotImplementedError

    def start_implementation(
        self, what: str, buffers: Sequence[Array], mpi_op: MPI.Op
    ) -> tuple[list[MPI.Request], Completion]:
        """Collective, at two ranks or more: start reducing each of ``buffers`` in place (:meth:`start`'s work;
        every MPI call started here, none in the step)."""
        raise NotImplementedError
