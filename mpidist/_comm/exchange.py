"""Collectives that move rows between ranks without combining them: alltoall, gather to a root, scatter from it.

Part of the comm layer: the data stages of :meth:`~mpidist.Communicator.alltoall`,
:meth:`~mpidist.Communicator.gather` and :meth:`~mpidist.Communicator.scatter`. The
communicator checks each rank's arguments and has the ranks agree on the call first
(:mod:`~mpidist._comm.agreement`: the dtype, the shape after axis 0, the root); a stage here runs
only once every rank is fine, so each of its MPI calls is made by every rank. What travels:

- alltoall with even splits: one ``MPI_Alltoall`` (each rank sends ``shape[0] / N`` rows to every
  rank, and, the shapes being agreed, receives as many from each); with each rank's own splits:
  one ``MPI_Alltoall`` of N integers (the rows each rank receives from each), then one
  ``MPI_Alltoallv``;
- gather: one ``MPI_Gather`` of each rank's length to the root, then one ``MPI_Gatherv``;
- scatter: one ``MPI_Scatter`` of a fixed-size header per rank (its array's dtype and shape), then
  one ``MPI_Scatterv``, from one buffer into which the root packs the arrays.

Only the root handles every rank's data; the others send and receive their own. Arrays travel as
buffers, never pickled, through :meth:`~mpidist._comm.backend.Backend.to_mpi` (device arrays
staged through host memory when MPI is not CUDA-aware; 16-bit floats, bfloat16 included, as their
bits).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.agreement import SMALL, Call, Kind
from mpidist._comm.backend import Backend, array_module, as_array, is_device_array, to_host
from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._comm.handle import Stage
    from mpidist._typing import Array

__all__ = ["AlltoallPlan", "Exchange", "mpi_datatype", "offsets", "send_counts"]

_MAX_DIMS = 64  # NumPy's limit
_NAME_SLOTS = 2  # int64 slots of a scatter header that spell the dtype's name (16 bytes)
_HEADER = 1 + _NAME_SLOTS + _MAX_DIMS  # ndim, the dtype's name, the shape


def send_counts(splits: Any, rows: int, size: int) -> list[int]:
    """Local: the rows of axis 0 an alltoall sends to each of ``size`` ranks, in rank order.

    ``splits`` is one non-negative integer per rank adding up to ``rows``: a sequence of Python or
    NumPy integers, or a 1-d integer array of any library (a device array is copied to the host);
    ``None`` splits the rows evenly. Raises ``ValueError`` saying what is wrong (without a rank:
    the caller adds it).
    """
    if splits is None:
        if rows % size:
            raise ValueError(
                f"{rows} rows cannot be split evenly over {size} ranks; pass splits, one row count per rank"
            )
        return [rows // size] * size
    counts = _integers(splits)
    if len(counts) != size or min(counts, default=0) < 0 or sum(counts) != rows:
        raise ValueError(f"splits {counts} must be {size} non-negative integers adding up to the {rows} rows of axis 0")
    return counts


def _integers(splits: Any) -> list[int]:
    """``splits`` as a list of Python ints, or ``ValueError`` when it is not a 1-d collection of integers."""
    if splits.__class__ is list and all(c.__class__ is int for c in splits):  # the common case, first
        return list(splits)
    values = as_array(splits)
    if hasattr(values, "dtype") and hasattr(values, "shape"):  # a NumPy or CuPy array, or another library's
        host = to_host(values)
        if host.dtype.kind not in "iu" or host.ndim != 1:
            raise ValueError(f"splits must be a 1-d array of integers, got {host.dtype} of shape {tuple(host.shape)}")
        return [int(c) for c in host.tolist()]
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"splits must be a sequence of integers, got {splits!r}") from None
    for c in items:
        if not isinstance(c, (int, np.integer)) or isinstance(c, bool):
            raise ValueError(f"splits must be integers, got {c!r} ({type(c).__name__}) in {items}")
    return [int(c) for c in items]


class AlltoallPlan:
    """What every alltoall of arrays like one needs, worked out once (Local): see :meth:`Exchange.plan`.

    ``call`` is the call the ranks agree on. The agreement record carries an
    ``N x N`` grid of blocks in its data slots, ``grid[to, from]``, when it
    fits (``carry`` slots, else 0): each rank fills its own column and leaves
    the rest 0, so the summed record holds every block, and rank ``r`` reads
    row ``r``. With even splits a block holds the rows for one rank, as the
    bits of their elements (unsigned integers of at most 32 bits, exact in
    ``float64``): the rows arrive with the agreement and no data call
    follows. With splits of each rank's own a block holds the count: the
    counts arrive with the agreement and the rows follow in one
    ``MPI_Alltoallv``. Host arrays only (a device array's rows would have to
    be copied to the host first).
    """

    __slots__ = (
        "call",
        "what",
        "count",
        "tail",
        "row",
        "word",
        "grid",
        "column",
        "mine",
        "carry",
        "agreed",
        "datatype",
    )

    def __init__(self, name: str, array: Array, count: Optional[int], size: int, rank: int) -> None:
        extra = None if count is None else (count,)
        self.call = Call(Kind.ALLTOALL, name, None, array.dtype.char, tuple(array.shape), extra=extra)
        self.what = f"alltoall of {name!r}"
        self.count = count  # rows to each rank with even splits, else None
        self.tail = tuple(array.shape[1:])
        self.row = math.prod(self.tail)
        self.word = np.dtype(f"u{min(array.dtype.itemsize, 4)}")  # the bits of one element, in 1 to 4 words
        block = 1 if count is None else count * self.row * array.dtype.itemsize // self.word.itemsize
        fits = 0 < size * size * block <= SMALL and (count is None or not is_device_array(array))
        self.carry = size * size * block if fits else 0
        self.grid = np.zeros((size, size, block))
        self.column = self.grid[:, rank]  # this rank's blocks: (size, block)
        self.mine = slice(rank * size * block, (rank + 1) * size * block)  # the blocks sent to this rank
        self.agreed: Any = None  # the agreement's plan of this call (set by the communicator)
        self.datatype: Optional[MPI.Datatype] = None  # of the buffers MPI moves (set at the first transfer)

    def image(self, array: Array, counts: list[int]) -> Optional[np.ndarray]:
        """Local: this rank's data slots of the record for an alltoall of ``array`` (``None`` when none is carried)."""
        if not self.carry:
            return None
        if self.count is None:
            self.column[:, 0] = counts
        else:
            self.column[...] = array.view(self.word).reshape(self.column.shape)  # C-contiguous (validated)
        return self.grid.reshape(-1)


def mpi_datatype(buffer: Array) -> MPI.Datatype:
    """The MPI datatype of the elements of ``buffer``, a buffer from :meth:`Backend.to_mpi`."""
    return MPI.Datatype.fromcode(buffer.dtype.char)


def offsets(counts: list[int]) -> list[int]:
    """Where each of ``counts`` consecutive blocks starts."""
    return list(itertools.accumulate(counts[:-1], initial=0))


class Exchange:
    """The data stages of alltoall, gather and scatter, on one communicator's transport.

    Local construction; each method is collective, called once the ranks agreed on the call.
    """

    def __init__(self, transport: Transport, backend: Backend, cuda_aware: bool) -> None:
        self._transport = transport
        self._backend = backend
        self._cuda_aware = cuda_aware
        self._plans: dict[tuple, AlltoallPlan] = {}

    def plan(self, name: str, array: Array, count: Optional[int]) -> AlltoallPlan:
        """Local: the :class:`AlltoallPlan` for alltoalls of arrays like ``array`` called ``name`` (cached).

        ``count``: the rows to each rank with even splits, else ``None``.
        """
        key = (name, array.dtype.char, array.shape, count, array.__class__)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = AlltoallPlan(name, array, count, self._transport.size, self._transport.rank)
        return plan

    def alltoall(self, plan: AlltoallPlan, array: Array, counts: list[int], blocking: bool, carried: Any) -> Any:
        """Collective: rows ``counts[r]`` of ``array`` (in order along axis 0) to rank ``r``.

        Returns ``(received, received counts)``: the rows from every rank, in rank order, as a new
        array of ``array``'s module, and how many came from each rank (a NumPy ``int64`` array).
        With even splits (``plan.count``, agreed) no counts travel. ``carried``: the sums of the
        agreement record's data slots, when the ranks' images (:meth:`AlltoallPlan.image`) went
        there: then the rows (even splits) or the counts arrived with the agreement. Nonblocking:
        the receive counts are exchanged now, and the data stage is returned (its requests, and
        the step that completes it, which makes no MPI call).
        """
        t, backend, n, what = self._transport, self._backend, self._transport.size, plan.what
        count = plan.count
        if count is not None:
            receives = np.array(counts, dtype=np.int64)  # every rank sends each as many rows as it receives
            rows = n * count
            if carried is not None:
                result = carried[plan.mine].astype(plan.word).view(array.dtype).reshape((rows, *plan.tail))
                return (result, receives) if blocking else ([], lambda: (result, receives))
        else:
            if carried is not None:
                receives = carried[plan.mine].astype(np.int64)
            else:
                receives = np.empty(n, dtype=np.int64)
                t.run(f"{what} (counts)", "Alltoall", np.array(counts, dtype=np.int64), receives)
            got = receives.tolist()
            rows = sum(got)
        result = array_module(array).empty((rows, *plan.tail), dtype=array.dtype)
        send = backend.to_mpi(array, self._cuda_aware, reuse=blocking)
        recv = backend.to_mpi(result, self._cuda_aware, reuse=False)
        kind = plan.datatype
        if kind is None:
            kind = plan.datatype = mpi_datatype(send)
        if count is not None:
            mpi_name, args = "Alltoall", ([send.reshape(-1), kind], [recv.reshape(-1), kind])
        else:
            row = plan.row
            sent, received = [c * row for c in counts], [c * row for c in got]
            mpi_name = "Alltoallv"
            args = (
                [send.reshape(-1), (sent, offsets(sent)), kind],
                [recv.reshape(-1), (received, offsets(received)), kind],
            )

        buffers = (send, recv)  # held by the finishing step until the transfer completed (MPI reads send till then)

        def finish() -> tuple[Any, np.ndarray]:
            backend.from_mpi(result, buffers[1])
            return result, receives

        if not blocking:
            stage: Stage = ([t.start(mpi_name, *args)], finish)
            return stage
        t.run(what, mpi_name, *args)
        return finish()

    def gather(self, array: Array, root: int, what: str) -> Optional[Any]:
        """Collective: every rank's ``array`` concatenated along axis 0 on ``root`` (a new array of its module);
        ``None`` on the other ranks. A 0-d array counts as one row."""
        t, backend = self._transport, self._backend
        shape = tuple(array.shape) if array.ndim else (1,)
        tail = shape[1:]
        lengths = np.empty(t.size, dtype=np.int64) if t.rank == root else None
        t.run(f"{what} (lengths)", "Gather", np.array([shape[0]], dtype=np.int64), lengths, root)
        send = backend.to_mpi(array, self._cuda_aware)
        kind = mpi_datatype(send)
        if lengths is None:
            t.run(what, "Gatherv", [send.reshape(-1), kind], None, root)
            return None
        result = array_module(array).empty((int(lengths.sum()),) + tail, dtype=array.dtype)
        recv = backend.to_mpi(result, self._cuda_aware, reuse=False)
        counts = (lengths * math.prod(tail)).tolist()
        t.run(
            what,
            "Gatherv",
            [send.reshape(-1), kind],
            [recv.reshape(-1), (counts, offsets(counts)), kind],
            root,
        )
        backend.from_mpi(result, recv)
        return result

    def scatter(self, arrays: Optional[Sequence[Array]], root: int, what: str) -> Any:
        """Collective: root's ``arrays[r]`` (one per rank, of one dtype; ignored elsewhere) to rank ``r``.

        Returns this rank's array as a new array of the backend's module, of the shape and dtype
        the root gave it.
        """
        t, backend = self._transport, self._backend
        header = np.zeros(_HEADER, dtype=np.int64)
        headers = np.stack([_header(a) for a in arrays]) if arrays is not None else None
        t.run(f"{what} (shapes)", "Scatter", headers, header, root)
        dtype, shape = _read_header(header)
        result = backend.xp.empty(shape, dtype=dtype)
        recv = backend.to_mpi(result, self._cuda_aware, reuse=False)
        kind = mpi_datatype(recv)
        packed: Any = None
        if arrays is not None:
            xp = array_module(arrays[0])
            joined = xp.concatenate([a.reshape(-1) for a in arrays])
            sizes = [int(a.size) for a in arrays]
            packed = [backend.to_mpi(joined, self._cuda_aware), (sizes, offsets(sizes)), kind]
        t.run(what, "Scatterv", packed, [recv.reshape(-1), kind], root)
        backend.from_mpi(result, recv)
        return result


def _header(array: Array) -> np.ndarray:
    """The scatter header of ``array``: its number of dimensions, its dtype's name and its shape."""
    header = np.zeros(_HEADER, dtype=np.int64)
    header[0] = array.ndim
    name = array.dtype.name.encode()
    header[1 : 1 + _NAME_SLOTS].view(np.uint8)[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    header[1 + _NAME_SLOTS : 1 + _NAME_SLOTS + array.ndim] = array.shape
    return header


def _read_header(header: np.ndarray) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape a scatter header (:func:`_header`) describes."""
    ndim = int(header[0])
    name = header[1 : 1 + _NAME_SLOTS].tobytes().rstrip(b"\0").decode()
    return _dtype_named(name), tuple(int(d) for d in header[1 + _NAME_SLOTS : 1 + _NAME_SLOTS + ndim])


def _dtype_named(name: str) -> np.dtype[Any]:
    """The dtype called ``name`` (NumPy's, or bfloat16 of ml_dtypes, which the root had)."""
    if name == "bfloat16":
        import ml_dtypes  # an optional dependency, imported only where a bfloat16 array exists

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
