"""Reductions of 16-bit floats (float16, and bfloat16 of ml_dtypes) through float32, rounded once.

MPI has no bfloat16 datatype, and the float16 reductions some MPI libraries
offer round to 16 bits at every combine of two ranks' values, so that the
result depends on the library's reduction order. mpidist reduces both in
float32 instead: a piece of the array at a time is copied into a float32
buffer (exactly: float32 holds every 16-bit float), that buffer is reduced by
the algorithm the communicator chooses, a ``MEAN`` is divided there, and the
result is rounded to 16 bits once (to float16 on the host by
:class:`Narrowing`, which compressed reductions use too). So a ``SUM`` is the float32 sum rounded
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

from typing import TYPE_CHECKING, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.algorithms import Algorithms
from mpidist._comm.algorithms.base import Completion, nothing
from mpidist._comm.backend import Backend, array_module
from mpidist._comm.reduce_op import ReduceOp, divide_in_place
from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Narrowing", "Widening"]

_WIDE = np.dtype(np.float32)
_HALF = np.dtype(np.float16)
_CHUNK = 1 << 16  # elements a Narrowing rounds at a time (its scratch: 2.3 MiB)


class Narrowing:
    """Local: float32 values rounded to float16 into host arrays, faster than NumPy's cast (:meth:`into`).

    NumPy casts float32 to float16 one element at a time (3.5-6.7 ns per
    element measured on a CPU with F16C); these integer steps over NumPy
    arrays of up to ``chunk`` elements (scratch held here, reused) give the
    same bits, round to nearest even, in 60-70% of the time. NaN is the
    one exception: any NaN becomes the quiet NaN of its sign, where NumPy
    keeps part of the payload. Other targets (bfloat16, device arrays) take
    their own cast.
    """

    def __init__(self, chunk: int) -> None:
        self._chunk = chunk
        self._scratch: Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = None

    def into(self, out: Array, values: Array) -> None:
        """Local: ``out`` (flat, 16-bit) <- the float32 ``values`` (flat, as long), rounded once."""
        if type(out) is not np.ndarray or out.dtype != _HALF or type(values) is not np.ndarray:
            out[...] = values
            return
        for lo in range(0, values.size, self._chunk):
            self._chunk_into(out[lo : lo + self._chunk], values[lo : lo + self._chunk])

    def _chunk_into(self, out: np.ndarray, values: np.ndarray) -> None:
        """:meth:`into` for at most ``chunk`` elements (float to half, round to nearest even, after F. Giesen)."""
        if self._scratch is None:
            c = self._chunk
            self._scratch = (np.empty(c, np.uint32), np.empty(c, np.uint32), np.empty(c, np.float32), np.empty(c, bool))
        n = values.size
        magnitude, half, tiny, where = (a[:n] for a in self._scratch)
        bits = values.view(np.uint32)
        np.bitwise_and(bits, 0x7FFFFFFF, out=magnitude)
        # normal results: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even
        np.right_shift(magnitude, 13, out=half)
        np.bitwise_and(half, 1, out=half)
        np.add(half, magnitude, out=half)
        np.add(half, np.uint32(0xC8000FFF), out=half)  # ((15 - 127) << 23) + 0xFFF, modulo 2**32
        np.right_shift(half, 13, out=half)
        # from 65536 up (65520 rounds to Inf above): Inf; NaN: the quiet NaN
        np.greater_equal(magnitude, 0x47800000, out=where)
        np.copyto(half, 0x7C00, where=where)
        np.greater(magnitude, 0x7F800000, out=where)
        np.copyto(half, 0x7E00, where=where)
        # below 2**-14 (subnormal results and zero): float32 addition of 0.5 rounds at float16's subnormal step
        np.less(magnitude, 0x38800000, out=where)
        with np.errstate(invalid="ignore"):  # a signalling NaN's sum, replaced below
            np.add(magnitude.view(np.float32), np.float32(0.5), out=tiny)
        low = tiny.view(np.uint32)
        np.subtract(low, 0x3F000000, out=low)
        np.copyto(half, low, where=where)
        # the sign
        np.right_shift(bits, 16, out=magnitude)
        np.bitwise_and(magnitude, 0x8000, out=magnitude)
        np.bitwise_or(half, magnitude, out=half)
        np.copyto(out.view(np.uint16), half, casting="unsafe")


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
        self._narrowing = Narrowing(_CHUNK)

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
            self._narrowing.into(part, piece)

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
            self._narrowing.into(buffer, wide)

        return requests, finish

    def _buffer(self, like: Array) -> Array:
        """The reusable float32 buffer for ``like``'s array type: ``options.piece_bytes`` (at least one element)."""
        key = type(like)
        wide = self._buffers.get(key)
        if wide is None:
            elements = max(1, self._transport.options.piece_bytes // _WIDE.itemsize)
            wide = self._buffers[key] = array_module(like).empty(elements, dtype=_WIDE)
        return wide
