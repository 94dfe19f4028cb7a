"""Wire compression of float32 reductions: 16 bits on the wire, float32 wherever the data is local.

With ``compression="fp16"`` or ``"bf16"`` (the option, or a per-call
argument) a blocking ``SUM`` or ``MEAN`` of float32 data is reduced in
pieces of ``options.piece_bytes``, each as follows over N ranks:

1. every rank rounds its piece to 16 bits once (float16, or ml_dtypes'
   bfloat16) and cuts it into N contiguous slices (the last ones padded
   with zeros);
2. one ``MPI_Alltoall`` of the 16-bit slices: rank r receives slice r of
   every rank;
3. rank r widens them to float32 and sums them there (``MEAN``: divides by N),
   then rounds its slice's sums to 16 bits once;
4. one ``MPI_Allgather`` of the rounded slices, which every rank widens into
   the float32 output.

Every value crosses each link once in 16 bits each way: half the bytes of
an exact ring allreduce. With the two-level algorithm
(:mod:`~mpidist._comm.algorithms.hierarchical`, which
:meth:`~mpidist._comm.algorithms.Algorithms.choose_compressed` picks for every
compressed reduction wherever it was built: ``hierarchical=True``, or ranks
across nodes with more than one on some node) the ranks of a node first
reduce onto their leader in float32, only the leaders exchange 16 bits as
above, and the leader broadcasts the float32 result within its node: one
rounding of each node's sum, and each node's sum crosses its link once in
16 bits each way.

Every rank ends with the same values (they come from the same 16-bit
slices), so every rank reaches the same verdict on them without another
message: a piece whose result holds Inf or NaN (a sum beyond float16's
range, ±65504, or a non-finite input) raises
:class:`~mpidist.NonFiniteError` on every rank. Pieces reduced before it
hold their results.

The conversions are NumPy's or CuPy's casts on the array's own device
(those of :mod:`~mpidist._comm.half`); the 16-bit slices reach MPI as their
bits through :meth:`~mpidist._comm.backend.Backend.to_mpi`. The scratch
buffers (two 16-bit and one float32 buffer of a piece, per array module,
encoding and group size) are reused across calls. The error bound is derived
in ``docs/compression.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.algorithms import Algorithms, Hierarchical
from mpidist._comm.backend import Backend, array_module
from mpidist._comm.reduce_op import ReduceOp, divide_in_place
from mpidist._comm.transport import Transport
from mpidist._dtypes import bfloat16
from mpidist._errors import NonFiniteError, on_rank
from mpidist._options import COMPRESSIONS

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Compression", "applies", "wire_error", "wire_of"]

_F32 = np.dtype(np.float32)
# 16-bit float dtypes' ranges, for messages
_RANGE = {"fp16": "float16's range (largest finite value 65504)", "bf16": "bfloat16's range (as float32's)"}


def applies(wire: Optional[str], op: Optional[ReduceOp], dtype: np.dtype[Any]) -> bool:
    """Local: whether a reduction by ``op`` of ``dtype`` is compressed with ``wire``: float32 ``SUM``/``MEAN``."""
    return wire is not None and (op is ReduceOp.SUM or op is ReduceOp.MEAN) and dtype == _F32


def wire_of(requested: Any, default: Optional[str], rank: int) -> tuple[Optional[str], Optional[Exception]]:
    """Local: the encoding a call uses: ``requested`` (``None``: ``default``, the option; ``"none"``: exact),
    and the error for a value that is none of ``None``, ``"none"``, ``"fp16"``, ``"bf16"``."""
    if requested is None:
        return default, None
    low = requested.strip().lower() if isinstance(requested, str) else None
    if low == "none":
        return None, None
    if low in COMPRESSIONS:
        return low, None
    return None, ValueError(on_rank(rank, f"compression must be 'fp16', 'bf16', 'none' or None, got {requested!r}"))


def wire_error(
    wire: Optional[str],
    arrays: Sequence[Array],
    ops: Sequence[Optional[ReduceOp]],
    names: Sequence[str],
    rank: int,
    what: str,
) -> Optional[Exception]:
    """Local: the error for a call that asked for ``wire`` explicitly where one of its arrays cannot be
    compressed (not float32, or an op other than SUM and MEAN); ``None`` when every array can."""
    if wire is None:
        return None
    for array, op, name in zip(arrays, ops, names):
        if not applies(wire, op, array.dtype):
            reduction = "rank 0's value (no reduction)" if op is None else f"a {op.name}"
            return ValueError(
                on_rank(
                    rank,
                    f"{what}: compression={wire!r} applies to SUM and MEAN of float32 only; {name!r} is "
                    f"{reduction} of {array.dtype}. Reduce it exactly "
                    "(compression='none'), or set the compression on the strategy, which leaves such "
                    "reductions exact",
                )
            )
    return None


class Compression:
    """Compressed reductions of flat float32 buffers, in place (see the module docstring).

    Local construction over a communicator's transport, algorithms, backend and CUDA-awareness;
    :meth:`reduce` is collective.
    """

    def __init__(self, transport: Transport, algorithms: Algorithms, backend: Backend, cuda_aware: bool) -> None:
        self._transport = transport
        self._choose = algorithms.choose_compressed
        self._backend = backend
        self._cuda_aware = cuda_aware
        self._step = max(1, transport.options.piece_bytes // _F32.itemsize)
        # (array type, encoding, group size) -> (16-bit slices sent, 16-bit slices received, float32 widened)
        self._scratch: dict[tuple[type, str, int], tuple[Array, Array, Array]] = {}

    def reduce(self, what: str, buffer: Array, op: ReduceOp, wire: str) -> None:
        """Collective: the flat float32 ``buffer`` <- ``op`` (SUM or MEAN) of every rank's, 16 bits on the wire.

        Raises :class:`~mpidist.NonFiniteError` on every rank when a piece's result is not finite.
        """
        t = self._transport
        if t.size == 1:
            return
        backend = self._backend
        ready = backend.to_mpi(buffer, self._cuda_aware)
        reduction = self._choose()
        two_level = reduction if isinstance(reduction, Hierarchical) else None
        xp = array_module(ready)
        for lo in range(0, ready.size, self._step):
            piece = ready[lo : lo + self._step]
            if two_level is None:
                self._exchange(what, t.comm, piece, op, wire)
            else:

                def across(leaders: MPI.Intracomm, piece: Array = piece) -> None:
                    self._exchange(what, leaders, piece, op, wire)
                    backend.to_mpi(piece, self._cuda_aware)  # written on its device: ready for the broadcast

                two_level.stages(what, piece, MPI.SUM, across)
            if not bool(xp.isfinite(piece).all()):
                backend.from_mpi(buffer, ready)
                self._refuse(what, wire, xp, piece, lo)
        backend.from_mpi(buffer, ready)

    def _exchange(self, what: str, comm: MPI.Intracomm, piece: Array, op: ReduceOp, wire: str) -> None:
        """Collective over ``comm``: the float32 ``piece`` (MPI-ready) <- the sum of every rank's over ``comm``,
        through 16-bit slices (steps 1-4 of the module docstring); ``MEAN`` divides by the whole job's size."""
        if comm.size > 1:
            with np.errstate(over="ignore", invalid="ignore"):  # an Inf is refused on every rank, not warned of
                self._exchange_slices(what, comm, piece, op, wire)
        elif op is ReduceOp.MEAN:  # one leader: the node's float32 sum is the whole sum, nothing crosses a wire
            divide_in_place(piece, self._transport.size)

    def _exchange_slices(self, what: str, comm: MPI.Intracomm, piece: Array, op: ReduceOp, wire: str) -> None:
        """Collective over ``comm`` (of two ranks or more): steps 1-4 of the module docstring on ``piece``."""
        n, m = comm.size, piece.size
        k = -(-m // n)  # elements per slice
        sent, received, wide = self._buffers(piece, wire, n)
        sent, received, wide = sent[: n * k], received[: n * k], wide[: n * k]
        sent[:m] = piece  # the one rounding of each input
        sent[m:] = 0
        run, to_mpi = self._transport.run, self._backend.to_mpi
        run(what, "Alltoall", to_mpi(sent, self._cuda_aware), to_mpi(received, self._cuda_aware), comm=comm)
        wide[...] = received
        mine = wide[:k]
        for r in range(1, n):
            mine += wide[r * k : (r + 1) * k]
        if op is ReduceOp.MEAN:
            divide_in_place(mine, self._transport.size)
        own = sent[comm.rank * k : (comm.rank + 1) * k]
        own[...] = mine  # the one rounding of each sum
        run(what, "Allgather", MPI.IN_PLACE, to_mpi(sent, self._cuda_aware), comm=comm)
        piece[...] = sent[:m]

    def _buffers(self, like: Array, wire: str, n: int) -> tuple[Array, Array, Array]:
        """The reusable scratch buffers for pieces like ``like`` exchanged with ``wire`` over ``n`` ranks."""
        key = (type(like), wire, n)
        found = self._scratch.get(key)
        if found is None:
            xp = array_module(like)
            dtype = np.dtype(np.float16) if wire == "fp16" else bfloat16()
            length = -(-self._step // n) * n
            found = self._scratch[key] = (
                xp.empty(length, dtype=dtype),
                xp.empty(length, dtype=dtype),
                xp.empty(length, dtype=_F32),
            )
        return found

    def _refuse(self, what: str, wire: str, xp: Any, piece: Array, lo: int) -> None:
        """Local, on every rank alike: the error for a compressed piece whose result is not finite."""
        bad = ~xp.isfinite(piece)
        count = int(bad.sum())
        first = lo + int(xp.flatnonzero(bad)[0])
        raise NonFiniteError(
            on_rank(
                self._transport.rank,
                f"{what} with compression={wire!r}: the result is Inf or NaN at {count} element"
                f"{'s' if count > 1 else ''} (the first at flat index {first}): a sum beyond {_RANGE[wire]}, "
                "or a non-finite input. Every rank raises this; the output holds the pieces reduced before. "
                "Scale the values (a loss scale), use bf16, or reduce exactly (compression='none').",
            )
        )
