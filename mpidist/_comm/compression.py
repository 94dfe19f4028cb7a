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
an exact ring allreduce.

The pieces run as a pipeline, so that the link never waits for the
conversions: while the slices of :data:`AHEAD` pieces cross, the rank sums
and rounds an earlier piece, and while the rounded sums of :data:`BEHIND`
pieces are gathered, it widens an earlier one into the output. Each step is
a nonblocking ``MPI_Ialltoall`` or ``MPI_Iallgather`` (between two ranks, one
message each way: the same bits, point to point), and every rank starts them
in the same order.

With the two-level algorithm
(:mod:`~mpidist._comm.algorithms.hierarchical`, which
:meth:`~mpidist._comm.algorithms.Algorithms.choose_compressed` picks for every
compressed reduction wherever it was built: ``hierarchical=True``, or ranks
across nodes with more than one on some node) the ranks of a node first
reduce onto their leader in float32, only the leaders exchange 16 bits as
above, and the leader broadcasts the float32 result within its node: one
rounding of each node's sum, and each node's sum crosses its link once in
16 bits each way: each piece is reduced onto the leader, the leaders
exchange the whole buffer's pieces as the pipeline below, and each piece is
broadcast (:meth:`~mpidist._comm.algorithms.Hierarchical.stages`).

Every rank ends with the same values (they come from the same 16-bit
slices), so every rank reaches the same verdict on them without another
message: a piece whose result holds Inf or NaN (a sum beyond float16's
range, ±65504, or a non-finite input) raises :class:`~mpidist.NonFiniteError`
on every rank, once every piece was reduced. The pieces before it hold their
results (and were handed over as they landed: a large update applies each
piece to its variable while it is in cache); no later one is handed over.

The conversions run on the array's own device: rounding to float16 on the
host by :class:`~mpidist._comm.half.Narrowing` (the same bits as NumPy's cast
in 60-70% of its time), the rest by NumPy's or CuPy's casts; the 16-bit
slices reach MPI as their
bits through :meth:`~mpidist._comm.backend.Backend.to_mpi`. The scratch
buffers (a 16-bit row per piece in the pipeline, at most ``AHEAD + BEHIND + 1``
sent and ``AHEAD + 1`` received, and one float32 row, per array module,
encoding and group size: up to 44 MiB with the default 2 MiB pieces) are
reused across calls. The error bound is derived in ``docs/compression.md``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.algorithms import Algorithms, Hierarchical
from mpidist._comm.backend import Backend, array_module
from mpidist._comm.half import Narrowing
from mpidist._comm.reduce_op import ReduceOp, divide_in_place
from mpidist._comm.transport import Transport
from mpidist._dtypes import bfloat16
from mpidist._errors import NonFiniteError, on_rank
from mpidist._options import COMPRESSIONS

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Compression", "applies", "wire_error", "wire_of"]

_F32 = np.dtype(np.float32)
# The pipeline's depth (module docstring): pieces whose 16-bit slices are exchanged at once, and pieces whose rounded
# sums are gathered at once.
AHEAD = 16
BEHIND = 8
# Elements converted between two tests of MPI's progress (_chunks): 64 Ki, 0.1-0.5 ms of a conversion here
CHUNK = 1 << 16
# Tags of the point-to-point messages between two ranks (the deadline's are 7702-7704, the two-level leaders' 7710)
_TAG_EXCHANGE, _TAG_GATHER, _TAG_PROGRESS = 7720, 7721, 7722  # _TAG_PROGRESS: probed, never sent
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
        self._narrowing = Narrowing(CHUNK)
        # (array type, encoding, group size) -> (16-bit rows sent, 16-bit rows received, float32 widened): _buffers
        self._scratch: dict[tuple[type, str, int], tuple[Array, Array, Array]] = {}

    def reduce(
        self, what: str, buffer: Array, op: ReduceOp, wire: str, landed: Optional[Callable[[int, int], None]] = None
    ) -> None:
        """Collective: the flat float32 ``buffer`` <- ``op`` (SUM or MEAN) of every rank's, 16 bits on the wire.

        ``landed(lo, hi)`` (local) runs once ``buffer[lo:hi]``, a piece, holds its result, in the pieces'
        order (while it is likely in cache). Raises :class:`~mpidist.NonFiniteError` on every rank when a
        piece's result is not finite, once every piece was reduced: ``buffer`` then holds the results of the
        pieces before it, which ``landed`` was given, and ``landed`` is given no later one.
        """
        t = self._transport
        if t.size == 1:
            if landed is not None:
                landed(0, buffer.size)
            return
        backend, step = self._backend, self._step
        ready = backend.to_mpi(buffer, self._cuda_aware)
        xp = array_module(ready)
        bad: list[int] = []  # where the first piece whose result is not finite begins

        def finish(lo: int) -> None:
            if bad:
                return
            piece = ready[lo : lo + step]
            if not bool(xp.isfinite(piece).all()):
                bad.append(lo)
                return
            backend.from_mpi(buffer[lo : lo + step], piece)
            if landed is not None:
                landed(lo, lo + piece.size)

        reduction = self._choose()
        with np.errstate(over="ignore", invalid="ignore"):  # an Inf is refused on every rank, not warned of
            if isinstance(reduction, Hierarchical):

                def across(leaders: MPI.Intracomm) -> None:
                    self._exchange(what, leaders, ready, op, wire, None)
                    backend.to_mpi(ready, self._cuda_aware)  # written on its device: ready for the broadcast

                starts = range(0, ready.size, step)
                pieces = [ready[lo : lo + step] for lo in starts]
                reduction.stages(what, pieces, MPI.SUM, across, lambda k: finish(starts[k]))
            else:
                self._exchange(what, t.comm, ready, op, wire, finish)
        if bad:
            self._refuse(what, wire, xp, ready[bad[0] : bad[0] + step], bad[0])

    def _exchange(
        self,
        what: str,
        comm: MPI.Intracomm,
        ready: Array,
        op: ReduceOp,
        wire: str,
        finish: Optional[Callable[[int], None]],
    ) -> None:
        """Collective over ``comm``: the float32 ``ready`` (MPI-ready) <- the sum of every rank's over ``comm``,
        by steps 1-4 of the module docstring on each piece, pipelined: step ``s`` rounds piece ``s`` and starts
        its exchange (steps 1-2), sums piece ``s - AHEAD`` and starts its gathering (steps 3-4), and widens
        piece ``s - AHEAD - BEHIND`` into ``ready``, calling ``finish(lo)`` (local) with where it begins.
        Every rank starts its calls in the same order. ``MEAN`` divides by the whole job's size."""
        t, n, rank = self._transport, comm.size, comm.rank
        if n == 1:  # one leader (finish: None): the node's float32 sum is the whole sum, nothing crosses a wire
            if op is ReduceOp.MEAN:
                divide_in_place(ready, t.size)
            return
        pieces = [ready[lo : lo + self._step] for lo in range(0, ready.size, self._step)]
        count = len(pieces)
        k = -(-pieces[0].size // n)  # elements per slice (of a whole piece; a ragged last one is padded)
        sent, received, wide = self._buffers(pieces[0], wire, n, count)
        sent, received, wide = sent[:, : n * k], received[:, : n * k], wide[: n * k]
        narrow = self._narrowing.into
        exchanges: list[list[MPI.Request]] = []
        gatherings: list[list[MPI.Request]] = []
        try:
            for s in range(count + AHEAD + BEHIND):
                if s < count:
                    row, piece = sent[s % len(sent)], pieces[s]
                    for lo, hi in self._chunks(what, comm, piece.size):
                        narrow(row[lo:hi], piece[lo:hi])  # the one rounding of each input
                    row[piece.size :] = 0
                    exchanges.append(self._start_exchange(what, comm, row, received[s % len(received)], k))
                i = s - AHEAD
                if 0 <= i < count:
                    t.wait(exchanges[i], what)
                    theirs, row = received[i % len(received)], sent[i % len(sent)]
                    for lo, hi in self._chunks(what, comm, k):
                        mine = wide[lo:hi]
                        mine[...] = theirs[lo:hi]
                        for r in range(1, n):
                            part = wide[r * k + lo : r * k + hi]
                            part[...] = theirs[r * k + lo : r * k + hi]
                            mine += part
                        if op is ReduceOp.MEAN:
                            divide_in_place(mine, t.size)
                        narrow(row[rank * k + lo : rank * k + hi], mine)  # the one rounding of each sum
                    gatherings.append(self._start_gathering(what, comm, row, k))
                j = i - BEHIND
                if 0 <= j < count:
                    t.wait(gatherings[j], what)
                    row, piece = sent[j % len(sent)], pieces[j]
                    for lo, hi in self._chunks(what, comm, piece.size):
                        piece[lo:hi] = row[lo:hi]
                    if finish is not None:
                        finish(j * self._step)
        except BaseException:  # MPI may still read or write the rows of the requests in flight: keep them
            t.stranded += [r for rs in (*exchanges, *gatherings) for r in rs if r]
            raise

    def _chunks(self, what: str, comm: MPI.Intracomm, size: int) -> Iterator[tuple[int, int]]:
        """Local: ``(lo, hi)`` ranges of :data:`CHUNK` elements covering ``size``, with a test of MPI's progress
        on ``comm`` between two of them: the messages in flight move only inside MPI calls (over TCP, a
        large message waits for its receiver's answer), so a rank that converts a piece in one go holds them
        up meanwhile."""
        for lo in range(0, size, CHUNK):
            if lo:
                self._transport.call(what, comm.Iprobe, MPI.ANY_SOURCE, _TAG_PROGRESS)
            yield lo, min(lo + CHUNK, size)

    def _start_exchange(self, what: str, comm: MPI.Intracomm, row: Array, into: Array, k: int) -> list[MPI.Request]:
        """Collective over ``comm``, nonblocking: slice ``r`` of ``row`` (``k`` elements each) to rank ``r``, and
        rank ``r``'s slice for this rank into slice ``r`` of ``into`` (an alltoall; point to point between
        two ranks)."""
        to_mpi, cuda_aware = self._backend.to_mpi, self._cuda_aware
        if comm.size > 2:
            return [self._transport.start("Alltoall", to_mpi(row, cuda_aware), to_mpi(into, cuda_aware), comm=comm)]
        me, other = comm.rank, 1 - comm.rank
        into[me * k : (me + 1) * k] = row[me * k : (me + 1) * k]
        return self._pair(
            what,
            comm,
            to_mpi(row[other * k : (other + 1) * k], cuda_aware),
            to_mpi(into[other * k : (other + 1) * k], cuda_aware),
            _TAG_EXCHANGE,
        )

    def _start_gathering(self, what: str, comm: MPI.Intracomm, row: Array, k: int) -> list[MPI.Request]:
        """Collective over ``comm``, nonblocking: every rank's slice ``rank`` of ``row`` into slice ``rank`` of
        every rank's ``row`` (an allgather in place; point to point between two ranks)."""
        cuda_aware = self._cuda_aware
        if comm.size > 2:
            return [self._transport.start("Allgather", MPI.IN_PLACE, self._backend.to_mpi(row, cuda_aware), comm=comm)]
        ready = self._backend.to_mpi(row, cuda_aware)
        me, other = comm.rank, 1 - comm.rank
        return self._pair(what, comm, ready[me * k : (me + 1) * k], ready[other * k : (other + 1) * k], _TAG_GATHER)

    def _pair(self, what: str, comm: MPI.Intracomm, send: Array, into: Array, tag: int) -> list[MPI.Request]:
        """Local, nonblocking: receive the other rank's message into ``into`` and send ``send`` (of two ranks)."""
        call, other = self._transport.call, 1 - comm.rank
        return [call(what, comm.Irecv, into, other, tag), call(what, comm.Isend, send, other, tag)]

    def _buffers(self, like: Array, wire: str, n: int, count: int) -> tuple[Array, Array, Array]:
        """The reusable scratch of a pipeline of ``count`` pieces like ``like`` exchanged with ``wire`` over ``n``
        ranks: 16-bit rows sent (a piece's from its rounding to its widening) and received (from its exchange
        to its sum), and one float32 row; grown when too few."""
        key = (type(like), wire, n)
        sent_rows, received_rows = min(count, AHEAD + BEHIND + 1), min(count, AHEAD + 1)
        found = self._scratch.get(key)
        if found is None or len(found[0]) < sent_rows or len(found[1]) < received_rows:
            xp = array_module(like)
            dtype = np.dtype(np.float16) if wire == "fp16" else bfloat16()
            length = -(-self._step // n) * n
            found = self._scratch[key] = (
                xp.empty((sent_rows, length), dtype=dtype),
                xp.empty((received_rows, length), dtype=dtype),
                xp.empty(length, dtype=_F32),
            )
        return found

    def _refuse(self, what: str, wire: str, xp: Any, piece: Array, lo: int) -> None:
        """Local, on every rank alike: the error for a compressed piece (at ``lo``) whose result is not finite."""
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
