"""Reductions of 16-bit floats (float16, and bfloat16 of ml_dtypes) through float32, rounded once.

MPI has no bfloat16 datatype, and the float16 reductions some MPI libraries
offer round to 16 bits at every combine of two ranks' values, so that the
result depends on the library's reduction order. mpidist reduces both in
float32 instead: a piece of the array at a time is copied into a float32
buffer (exactly: float32 holds every 16-bit float), that buffer is reduced by
the algorithm the communicator chooses, a ``MEAN`` is divided there, and the
result is rounded to 16 bits once. So a ``SUM`` is the float32 sum rounded
once to the array's dtype, which is the exactly rounded sum whenever the
float32 sum is exact: when the exponents (powers of two) of an element's
values at N ranks differ by at most ``16 - ceil(log2(N))`` for bfloat16
(``13 - ceil(log2(N))`` for float16). ``MIN`` and ``MAX`` are exact. (Small
sums carried by the agreement record are summed in float64 and rounded once,
see :mod:`~mpidist._comm.agreement`.)

The blocking form needs one float32 buffer of ``options.piece_bytes`` per
array module, reused across calls; the nonblocking form widens the whole
array at once, since all its pieces are in flight together. Whatever only
moves 16-bit floats (broadcast, allgather, alltoall, gather, scatter) moves
their bits (:meth:`~mpidist._comm.backend.Backend.to_mpi`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from mpidist._comm.algorithms import Algorithms
from mpidist._comm.algorithms.base import Completion, nothing
from mpidist._comm.backend import Backend, array_module
from mpidist._comm.reduce_op import ReduceOp, divide_in_place
from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Widening"]

_WIDE = np.dtype(np.float32)


class Widening:
    """Reductions of flat 16-bit float buffers, in place, computed in float32 (see the module docstring).

    Local construction over a communicator's transport, algorithms, backend and
    CUDA-awareness; :meth:`reduce` and :meth:`start` are collective. Buffers
    may lie in host or device memory (a device buffer is widened on its
    device, and the float32 copy goes to MPI through
    :meth:`~mpidist._comm.backend.Backend.to_mpi`).
    """

    def __init__(self, transport: Transport, algorithms: Algorithms, backend: Backend, cuda_aware: bool) -> None:
        self._transport = transport
        self._choose = algorithms.choose
        self._backend = backend
        self._cuda_aware = cuda_aware
        self._buffers: dict[type, Array] = {}  # one float32 buffer of piece_bytes per array type

    def reduce(self, what: str, buffer: Array, op: ReduceOp) -> None:
        """Collective: the flat ``buffer`` <- ``op`` of every rank's, in float32 pieces, each rounded back once."""
        size = self._transport.size
        if size == 1:
            return
        backend, mpi_op = self._backend, self._transport.mpi_op(op, _WIDE)
        wide = self._buffer(buffer)
        step = wide.size
        reduction = self._choose(buffer.size * _WIDE.itemsize)
        for lo in range(0, buffer.size, step):
            part = buffer[lo : lo + step]
            piece = wide[: part.size]
            piece[...] = part
            ready = backend.to_mpi(piece, self._cuda_aware)
            reduction.reduce(what, ready, mpi_op)
            backend.from_mpi(piece, ready)
            if op is ReduceOp.MEAN:
                divide_in_place(piece, size)
            part[...] = piece

    def start(self, what: str, buffer: Array, op: ReduceOp) -> tuple[list[MPI.Request], Completion]:
        """Collective, nonblocking :meth:`reduce`: a float32 copy of the whole ``buffer`` reduced in pieces.

        Returns the requests and the local step that writes the rounded
        results into ``buffer`` once they completed (it makes no MPI call).
        """
        size = self._transport.size
        if size == 1:
            return [], nothing
        backend = self._backend
        wide = buffer.astype(_WIDE)
        ready = backend.to_mpi(wide, self._cuda_aware, reuse=False)
        reduction = self._choose(wide.nbytes)
        requests, complete = reduction.start(
            what, [ready[lo:hi] for lo, hi in reduction.pieces(ready)], self._transport.mpi_op(op, _WIDE)
        )

        def finish() -> None:
            complete()
            backend.from_mpi(wide, ready)
            if op is ReduceOp.MEAN:
                divide_in_place(wide, size)
            buffer[...] = wide

        return requests, finish

    def _buffer(self, like: Array) -> Array:
        """The reusable float32 buffer for ``like``'s array type: ``options.piece_bytes`` (at least one element)."""
        key = type(like)
        wide = self._buffers.get(key)
        if wide is None:
            elements = max(1, self._transport.options.piece_bytes // _WIDE.itemsize)
            wide = self._buffers[key] = array_module(like).empty(elements, dtype=_WIDE)
        return wide
