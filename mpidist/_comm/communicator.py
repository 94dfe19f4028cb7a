"""Typed collectives on NumPy/CuPy arrays over a private MPI communicator.

The only module that moves data through MPI. A :class:`Communicator` owns a
duplicate of the user's communicator, so its traffic never mixes with the
user's own messages. Every method documented as *collective* must be called by
every rank of the communicator, in the same order, with compatible arguments.

Before each collective the ranks agree on (sequence number, operation, reduce
op, dtype, shape); a disagreement raises :class:`~mpidist.CollectiveMismatchError`
on every rank before any data moves. With a timeout, the agreement runs over
nonblocking point-to-point messages polled against the deadline, so the
waiting ranks can name the ranks that never arrived
(:class:`~mpidist.CollectiveTimeoutError`). Arrays always travel as buffers,
never pickled; large reductions run in cache-sized pieces.
"""
from __future__ import annotations

import enum
import time
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from mpidist._comm.backend import Backend, array_module
from mpidist._comm.cuda_aware import resolve_cuda_aware
from mpidist._comm.hierarchy import Hierarchy, node_split
from mpidist._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommError,
    NonFiniteError,
    format_ranks,
)
from mpidist._comm.reduce_op import ReduceOp
from mpidist._options import Options

__all__ = ["Communicator", "Handle"]

# dtype chars MPI can move; their position is the dtype's code in agreement records.
_DTYPES = "?bhilqBHILQefdFD"
_FLOATS = set("efdFD")
_COMPLEX = set("FD")


class _Kind(enum.IntEnum):
    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    REDUCE_SCATTER = 4
    BARRIER = 5
    FUSED = 6


class _Bad(enum.IntEnum):
    """Why a rank could not take part, sent in its agreement record."""

    OK = 0
    NOT_ARRAY = 1
    NOT_CONTIGUOUS = 2
    DTYPE = 3
    OP_FOR_DTYPE = 4
    OTHER = 5


_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MEAN: MPI.SUM, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.PROD: MPI.PROD}
_BOOL_OPS = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND, ReduceOp.PROD: MPI.LAND}

_MAXDIM = 8
# Columns of an agreement record. _DIMS.. hold dims 1 and up (the last slot the product of any
# dims past _MAXDIM); _DIM0 the length along axis 0, compared except in allgather; _NONFINITE is
# per-rank information, never compared. Ranks agree when their records match up to _DIM0.
_SEQ, _KIND, _OP, _DTYPE, _NDIM, _BAD, _ROOT, _DIMS = range(8)
_DIM0 = _DIMS + _MAXDIM - 1
_NONFINITE = _DIM0 + 1
_RECORD = _NONFINITE + 1
_DTYPE_CODES = {c: i for i, c in enumerate(_DTYPES)}
_TAG_AGREE = 7701


def _nothing() -> None:
    """The completion step of requests that need none."""


def _local_error(bad: "_Bad", message: str) -> Exception:
    """The exception a rank raises for its own invalid arguments."""
    return (TypeError if bad in (_Bad.NOT_ARRAY, _Bad.DTYPE, _Bad.NOT_CONTIGUOUS) else ValueError)(message)


def _describe(record: np.ndarray) -> str:
    """Human form of one agreement record, e.g. ``allreduce(sum) float32[3, 4]``."""
    seq, kind, op, dcode, ndim, bad, root = (int(x) for x in record[:_DIMS])
    name = _Kind(kind).name.lower() if kind in _Kind._value2member_map_ else f"kind{kind}"
    if bad:
        return f"#{seq} {name}: could not take part ({_Bad(bad).name.lower().replace('_', ' ')})"
    if kind == _Kind.FUSED:
        return f"#{seq} fused reduction of {ndim} arrays, {int(record[_DIMS + 1])} elements"
    opname = next((o.value for o, c in _OP_CODES.items() if c == op), None)
    dims = [int(d) for d in record[_DIMS:_DIMS + min(ndim, _MAXDIM) - 1]]
    if ndim:
        dims.insert(0, int(record[_DIM0]))
    dtype = np.dtype(_DTYPES[dcode]).name if 0 <= dcode < len(_DTYPES) else "?"
    text = f"#{seq} {name}"
    if opname:
        text += f"({opname})"
    if kind == _Kind.BROADCAST:
        text += f"(root={root})"
    if kind != _Kind.BARRIER:
        text += f" {dtype}{dims}"
    return text


class Handle:
    """A nonblocking collective in flight. ``wait()`` completes it and returns its result."""

    def __init__(self, comm: "Communicator", what: str, requests: list[MPI.Request],
                 finish: Callable[[], Any]) -> None:
        self._comm = comm
        self._what = what
        self._requests = requests
        self._finish = finish
        self._done = False
        self._result: Any = None

    def test(self) -> bool:
        """Local: whether the operation has completed (does not run the finishing step)."""
        return self._done or bool(MPI.Request.Testall(self._requests))

    def wait(self) -> Any:
        """Local: block until complete (honouring the communicator's timeout); return the result."""
        if not self._done:
            self._comm._wait(self._requests, self._what)
            self._result = self._finish()
            self._done = True
        return self._result


class Communicator:
    """Collectives on arrays over a private duplicate of an MPI communicator.

    Collective construction: every rank of ``comm`` must create it together.
    Call :meth:`free` (or use it as a context manager) to release it; it is
    never freed from ``__del__``, because garbage collection runs in a
    different order on each rank.

    Args:
        comm: the mpi4py communicator to duplicate (default ``MPI.COMM_WORLD``).
        options: timeouts, checks and sizes (:class:`~mpidist._options.Options`);
            default: from ``MPIDIST_*`` environment variables.
        backend: where arrays live (:class:`~mpidist._comm.backend.Backend`); default:
            chosen by ``options.device``, binding this rank's GPU by its
            node-local rank.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, options: Optional[Options] = None,
                 backend: Optional[Backend] = None) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(base).__name__}")
        self.options = options if options is not None else Options.resolve()
        self._seq = 0
        self._broken: Optional[str] = None
        try:
            self._comm = base.Dup()
            self._node = node_split(self._comm)
            self._num_nodes = self._comm.allreduce(int(self._node.rank == 0))
        except MPI.Exception as exc:
            raise CommError(f"could not set up mpidist's communicator: {exc.Get_error_string()}") from exc
        self.rank: int = self._comm.rank
        self.size: int = self._comm.size
        self.local_rank: int = self._node.rank
        self.local_size: int = self._node.size
        self.backend = backend if backend is not None else Backend.select(self.options.device, self.local_rank)
        self.cuda_aware = resolve_cuda_aware(self._comm, self.backend, self.options.cuda_aware)
        self._hierarchy = Hierarchy(self._comm, self.options.node_size) if self.options.hierarchical else None

    # -- life cycle ----------------------------------------------------------------
    @property
    def mpi_comm(self) -> MPI.Intracomm:
        """The private duplicate communicator (for advanced use; don't free it)."""
        return self._comm

    @property
    def num_nodes(self) -> int:
        """Number of shared-memory nodes the ranks span."""
        return self._num_nodes

    def free(self) -> None:
        """Collective: release the duplicated communicators."""
        if self._hierarchy is not None:
            self._hierarchy.free()
        for c in (self._node, self._comm):
            if c != MPI.COMM_NULL:
                c.Free()
        self._broken = "the communicator was freed"

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._broken is None:
            self.free()

    def __repr__(self) -> str:
        return f"<Communicator rank {self.rank} of {self.size}, {self.backend!r}>"

    # -- collectives -------------------------------------------------------------
    def allreduce(self, array: Any, op: Union[ReduceOp, str] = ReduceOp.SUM, *, out: Any = None,
                  inplace: bool = False, name: str = "array") -> Any:
        """Collective: reduce ``array`` elementwise across all ranks.

        Returns the reduced array (``array`` itself when ``inplace``, else a new
        array, or ``out`` when given). ``MEAN`` divides the sum by the number of
        ranks and is only defined for floating and complex dtypes. With
        ``options.check_finite``, a NaN or Inf on any rank raises
        :class:`~mpidist.NonFiniteError` on every rank instead of spreading. Buffers
        larger than ``options.pipeline_bytes`` are reduced in pieces of that
        size, in place, without a full-size temporary; with
        ``options.hierarchical``, each piece by the two-level algorithm.
        """
        return self._allreduce(array, op, out, inplace, name, blocking=True)

    def iallreduce(self, array: Any, op: Union[ReduceOp, str] = ReduceOp.SUM, *, out: Any = None,
                   inplace: bool = False, name: str = "array") -> Handle:
        """Collective, nonblocking :meth:`allreduce`: returns a :class:`Handle`.

        Don't touch ``array`` (or ``out``) until ``handle.wait()`` returned.
        The pieces advance while this rank is inside MPI (``handle.test()``,
        ``wait()``, other MPI calls); whether they also advance during pure
        computation depends on the MPI library's progress engine.
        """
        return self._allreduce(array, op, out, inplace, name, blocking=False)

    def broadcast(self, array: Any, root: int = 0, *, name: str = "array") -> Any:
        """Collective: overwrite ``array`` on every rank with root's; returns ``array``.

        Every rank passes an array of the same shape and dtype.
        """
        return self._broadcast(array, root, name, blocking=True)

    def ibroadcast(self, array: Any, root: int = 0, *, name: str = "array") -> Handle:
        """Collective, nonblocking :meth:`broadcast`: returns a :class:`Handle`."""
        return self._broadcast(array, root, name, blocking=False)

    def allgather(self, array: Any, *, name: str = "array") -> Any:
        """Collective: concatenate every rank's ``array`` along axis 0, in rank order.

        Lengths along axis 0 may differ between ranks; the other dimensions and
        the dtype must agree. A 0-d array counts as one element. Returns a new
        array on every rank.
        """
        return self._allgather(array, name, blocking=True)

    def iallgather(self, array: Any, *, name: str = "array") -> Handle:
        """Collective, nonblocking :meth:`allgather`: returns a :class:`Handle`."""
        return self._allgather(array, name, blocking=False)

    def reduce_scatter(self, array: Any, op: Union[ReduceOp, str] = ReduceOp.SUM,
                       counts: Optional[Sequence[int]] = None, *, name: str = "array") -> Any:
        """Collective: reduce ``array`` across ranks, then give each rank its block of axis 0.

        ``counts[r]`` rows go to rank ``r``; by default rows are split as evenly
        as possible (the first ``len % size`` ranks get one more). Every rank
        passes the same shape. Returns this rank's block as a new array.
        """
        op = ReduceOp.of(op)
        self._agree(_Kind.REDUCE_SCATTER, array, op, name=name)
        rows = array.shape[0] if array.ndim else 1
        counts = self.split_counts(rows) if counts is None else [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != rows or min(counts) < 0:
            raise ValueError(f"rank {self.rank}: reduce_scatter of {name!r}: counts {counts} must be "
                             f"{self.size} non-negative numbers adding up to {rows} rows")
        row = int(np.prod(array.shape[1:], dtype=np.int64)) if array.ndim else 1
        result = array_module(array).empty((counts[self.rank],) + tuple(array.shape[1:]), dtype=array.dtype)
        send = self.backend.to_mpi(array, self.cuda_aware)
        recv = self.backend.to_mpi(result, self.cuda_aware, reuse=False)
        self._run(f"reduce_scatter of {name!r}", "Reduce_scatter", send, recv,
                  [c * row for c in counts], self._mpi_op(op, array.dtype))
        self.backend.from_mpi(result, recv)
        if op is ReduceOp.MEAN:
            result /= self.size
        return result

    def barrier(self) -> None:
        """Collective: return once every rank has entered (honours the timeout)."""
        if self._agreement_on():
            self._agree(_Kind.BARRIER, None, None, name="barrier")  # the exchange itself synchronises
            return
        self._seq += 1
        self._run("barrier", "Barrier")

    def split_counts(self, n: int) -> list[int]:
        """Local: ``n`` items split as evenly as possible over the ranks, lower ranks first."""
        base, extra = divmod(n, self.size)
        return [base + (1 if r < extra else 0) for r in range(self.size)]

    # -- small byte payloads (metadata, error reports) -------------------------------
    def allgather_bytes(self, data: bytes, *, name: str = "bytes") -> list[bytes]:
        """Collective: every rank's ``data`` (any length, also empty), as a list in rank order.

        For small metadata such as JSON descriptions and "did everyone
        succeed?" reports. The bytes travel as a ``uint8`` buffer, never
        pickled, through :meth:`allgather` (two calls: lengths, then payload),
        so agreement checks and the timeout apply.
        """
        local = np.frombuffer(bytes(data), dtype=np.uint8)
        lengths = self.allgather(np.array([local.size], dtype=np.int64), name=f"{name} (lengths)")
        joined = self.allgather(local, name=name).tobytes()
        ends = np.cumsum(lengths).tolist()
        return [joined[lo:hi] for lo, hi in zip([0] + ends[:-1], ends)]

    def broadcast_bytes(self, data: Optional[bytes], root: int = 0, *, name: str = "bytes") -> bytes:
        """Collective: root's ``data`` on every rank (the others' ``data`` is ignored; ``None`` is ``b""``).

        Like :meth:`allgather_bytes`: a ``uint8`` buffer, never pickled; two
        broadcasts (length, then payload).
        """
        mine = bytes(data or b"") if self.rank == root else b""
        length = self.broadcast(np.array([len(mine)], dtype=np.int64), root, name=f"{name} (length)")
        buffer = np.frombuffer(mine, dtype=np.uint8).copy() if self.rank == root else np.empty(int(length[0]), np.uint8)
        return self.broadcast(buffer, root, name=name).tobytes()

    # -- implementation ------------------------------------------------------------
    def _allreduce(self, array: Any, op: Union[ReduceOp, str], out: Any, inplace: bool, name: str,
                   blocking: bool) -> Any:
        op = ReduceOp.of(op)
        self._agree(_Kind.ALLREDUCE, array, op, name=name, check_finite=self.options.check_finite)
        if inplace and out is not None:
            raise ValueError(f"rank {self.rank}: allreduce of {name!r}: pass either inplace=True or out=, not both")
        if inplace:
            target = array
        elif out is not None:
            self._check_out(array, out, name)
            target = out
        else:
            target = array_module(array).empty_like(array)
        copied = target is not array and self.backend.needs_staging(array, self.cuda_aware)
        if copied:
            target[...] = array  # reduce a device copy in place: staging then needs one buffer
        send = None if target is array or copied else array
        recv = self.backend.to_mpi(target, self.cuda_aware, reuse=blocking)
        mpi_op = self._mpi_op(op, array.dtype)
        if (blocking and recv is target and self.options.timeout is None and self._hierarchy is None
                and target.nbytes <= self.options.pipeline_bytes):
            # the common small host case: one call, no pieces (this is the per-update latency path)
            self._call("allreduce", self._comm.Allreduce, MPI.IN_PLACE if send is None else send, target, mpi_op)
            if op is ReduceOp.MEAN:
                target[...] /= self.size
            return target

        flat_send = None if send is None else send.reshape(-1)
        flat_recv, flat_target = recv.reshape(-1), target.reshape(-1)
        pieces = [(None if send is None else flat_send[lo:hi], flat_recv[lo:hi]) for lo, hi in self._pieces(target)]
        what = f"allreduce of {name!r}"
        if not blocking:
            def finish() -> Any:
                self.backend.from_mpi(target, recv)
                if op is ReduceOp.MEAN:
                    target[...] /= self.size
                return target

            requests, complete = self._start_pieces(what, pieces, mpi_op)
            return Handle(self, what, requests, lambda: (complete(), finish())[1])
        staged = recv is not target
        for (sbuf, rbuf), (lo, hi) in zip(pieces, self._pieces(target)):
            self._reduce(what, sbuf, rbuf, mpi_op)
            if op is ReduceOp.MEAN and not staged:
                flat_target[lo:hi] /= self.size  # while the piece is in cache
        self.backend.from_mpi(target, recv)
        if op is ReduceOp.MEAN and staged:
            target[...] /= self.size
        return target

    def _reduce(self, what: str, send: Any, recv: Any, mpi_op: MPI.Op) -> None:
        """Collective: ``recv`` <- reduction of every rank's ``send`` (of ``recv`` itself if ``None``).

        Both are MPI-ready buffers; the two-level algorithm with ``options.hierarchical``.
        """
        if self._hierarchy is not None:
            self._hierarchy.allreduce(self, what, send, recv, mpi_op)
        else:
            self._run(what, "Allreduce", MPI.IN_PLACE if send is None else send, recv, mpi_op)

    def _start_pieces(self, what: str, pieces: Sequence[tuple[Any, Any]],
                      mpi_op: MPI.Op) -> tuple[list[MPI.Request], Callable[[], None]]:
        """Collective: start the nonblocking reduction of each ``(send or None, recv)`` piece.

        Returns the requests and the step to run once they completed. With
        ``options.hierarchical`` only the reductions within the nodes run in
        the background; that step runs the rest.
        """
        hierarchy = self._hierarchy
        if hierarchy is None:
            return [self._start("Allreduce", MPI.IN_PLACE if s is None else s, r, mpi_op) for s, r in pieces], _nothing

        def complete() -> None:
            for _, r in pieces:
                hierarchy.complete(self, what, r, mpi_op)

        return [hierarchy.start(self, s, r, mpi_op) for s, r in pieces], complete

    def _broadcast(self, array: Any, root: int, name: str, blocking: bool) -> Any:
        if not 0 <= root < self.size:
            raise ValueError(f"rank {self.rank}: broadcast of {name!r}: root {root} is not a rank of a "
                             f"{self.size}-rank communicator")
        self._agree(_Kind.BROADCAST, array, None, root=root, name=name)
        buf = self.backend.to_mpi(array, self.cuda_aware, reuse=blocking)

        def finish() -> Any:
            self.backend.from_mpi(array, buf)
            return array

        what = f"broadcast of {name!r}"
        args = (buf.reshape(-1), root)
        if not blocking:
            return Handle(self, what, [self._start("Bcast", *args)] if array.size else [], finish)
        if array.size:
            self._run(what, "Bcast", *args)
        return finish()

    def _allgather(self, array: Any, name: str, blocking: bool) -> Any:
        records = self._agree(_Kind.ALLGATHER, array, None, name=name)
        shape = tuple(array.shape) if array.ndim else (1,)
        if records is None:  # no agreement exchange: gather the lengths alone
            lengths = np.array(self._call("allgather", self._comm.allgather, shape[0]), dtype=np.int64)
        else:
            lengths = np.where(records[:, _NDIM] > 0, records[:, _DIM0], 1)
        counts = lengths * int(np.prod(shape[1:], dtype=np.int64))
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        result = array_module(array).empty((int(lengths.sum()),) + shape[1:], dtype=array.dtype)
        send = self.backend.to_mpi(array, self.cuda_aware, reuse=False)
        recv = self.backend.to_mpi(result, self.cuda_aware, reuse=False)

        def finish() -> Any:
            self.backend.from_mpi(result, recv)
            return result

        what = f"allgather of {name!r}"
        dtype = MPI.Datatype.fromcode(array.dtype.char)
        args = ([send.reshape(-1), dtype], [recv.reshape(-1), (counts.tolist(), displs.tolist()), dtype])
        if not blocking:
            return Handle(self, what, [self._start("Allgatherv", *args)], finish)
        self._run(what, "Allgatherv", *args)
        return finish()

    def _pieces(self, array: Any) -> list[tuple[int, int]]:
        step = max(1, self.options.pipeline_bytes // max(1, array.itemsize))
        return [(lo, min(lo + step, array.size)) for lo in range(0, array.size, step)]

    def _mpi_op(self, op: ReduceOp, dtype: np.dtype) -> MPI.Op:
        return _BOOL_OPS[op] if dtype.char == "?" else _MPI_OPS[op]

    def _check_out(self, array: Any, out: Any, name: str) -> None:
        if getattr(out, "shape", None) != array.shape or getattr(out, "dtype", None) != array.dtype:
            raise ValueError(f"rank {self.rank}: allreduce of {name!r}: out= must have the input's shape "
                             f"{tuple(array.shape)} and dtype {array.dtype}, got "
                             f"{getattr(out, 'shape', '?')} {getattr(out, 'dtype', type(out).__name__)}")
        if not out.flags.c_contiguous:
            raise TypeError(f"rank {self.rank}: allreduce of {name!r}: out= must be C-contiguous")

    # -- validation and agreement ---------------------------------------------------
    def _validate(self, array: Any, op: Optional[ReduceOp], name: str) -> tuple[_Bad, str]:
        """Local checks of one rank's arguments: (reason code, message) or (OK, "")."""
        where = f"rank {self.rank}: {name!r}"
        if not (hasattr(array, "dtype") and hasattr(array, "shape") and hasattr(array, "flags")):
            return _Bad.NOT_ARRAY, (f"{where} is a {type(array).__name__}, not an array; pass a NumPy "
                                    "or CuPy array (numpy.asarray(x))")
        char = array.dtype.char
        if char not in _DTYPES:
            return _Bad.DTYPE, (f"{where} has dtype {array.dtype}, which mpidist cannot send; use one of "
                                "bool, int8-64, uint8-64, float16/32/64, complex64/128")
        if not array.flags.c_contiguous:
            return _Bad.NOT_CONTIGUOUS, (f"{where} (shape {tuple(array.shape)}, dtype {array.dtype}) is not "
                                         "C-contiguous; pass a contiguous copy (numpy.ascontiguousarray(x))")
        if op is ReduceOp.MEAN and char not in _FLOATS:
            return _Bad.OP_FOR_DTYPE, (f"{where}: MEAN of dtype {array.dtype} would truncate; reduce a "
                                       "floating-point copy, or use SUM and divide yourself")
        if op in (ReduceOp.MIN, ReduceOp.MAX) and char in _COMPLEX:
            return _Bad.OP_FOR_DTYPE, f"{where}: {op.name} is not defined for complex dtype {array.dtype}"
        return _Bad.OK, ""

    def _agreement_on(self) -> bool:
        return self.options.check_collectives or self.options.timeout is not None

    def _begin(self) -> int:
        """Local: number the next collective (raises if the communicator is unusable)."""
        if self._broken is not None:
            raise CommError(f"rank {self.rank}: communicator unusable: {self._broken}")
        self._seq += 1
        return self._seq

    def _agree(self, kind: _Kind, array: Any, op: Optional[ReduceOp], *, root: int = 0,
               name: str, check_finite: bool = False) -> Optional[np.ndarray]:
        """Validate locally, then (if enabled) exchange records and compare them on every rank.

        Returns all ranks' records (``size x _RECORD``) or ``None`` when the
        exchange is disabled. Raises the local error on a rank whose arguments
        are invalid and :class:`CollectiveMismatchError` on the others.
        """
        self._begin()
        bad, message = (_Bad.OK, "") if kind == _Kind.BARRIER else self._validate(array, op, name)
        if not (self._agreement_on() or check_finite):
            if bad:
                raise _local_error(bad, message)
            return None
        fields = [self._seq, kind, _OP_CODES.get(op, 0), 0, 0, bad, root] + [0] * (_RECORD - _DIMS)
        if kind != _Kind.BARRIER and not bad:
            shape = array.shape
            fields[_DTYPE] = _DTYPE_CODES[array.dtype.char]
            fields[_NDIM] = len(shape)
            if shape:
                rest = list(shape[1:_MAXDIM - 1])
                if len(shape) >= _MAXDIM:
                    rest.append(int(np.prod(shape[_MAXDIM - 1:])))
                fields[_DIMS:_DIMS + len(rest)] = rest
                fields[_DIM0] = shape[0]
            if check_finite and array.dtype.char in _FLOATS:
                fields[_NONFINITE] = int(not bool(array_module(array).isfinite(array).all()))
        return self._settle(kind, np.array(fields, dtype=np.int64), bad, message, name)

    def _settle(self, kind: _Kind, record: np.ndarray, bad: _Bad, message: str, name: str,
                explain: Optional[Callable[[], str]] = None) -> np.ndarray:
        """Collective: exchange this rank's agreement ``record``; raise on any disagreement.

        ``explain`` (collective, run on every rank when all took part but
        disagree) returns text to add to the mismatch error.
        """
        records = self._exchange(record, kind, name)
        if bad:
            raise _local_error(bad, message)
        if not record[_NONFINITE] and records.tobytes() == record.tobytes() * self.size:
            return records  # the common case: every rank sent the same record
        self._compare(kind, records, name, explain)
        if records[:, _NONFINITE].any():
            nonfinite = [r for r in range(self.size) if records[r, _NONFINITE]]
            raise NonFiniteError(
                f"rank {self.rank}: {kind.name.lower()} of {name!r}: rank{'s' if len(nonfinite) > 1 else ''} "
                f"{format_ranks(nonfinite)} contributed NaN or Inf; nothing was reduced, so the other replicas "
                "keep finite values. Find where the non-finite values come from (learning rate, loss scale, "
                "bad input), or turn the guard off with check_finite=False.", nonfinite)
        return records

    def _compare(self, kind: _Kind, records: np.ndarray, name: str,
                 explain: Optional[Callable[[], str]] = None) -> None:
        mine = records[self.rank]
        key = records[:, :_DIM0 if kind == _Kind.ALLGATHER else _DIM0 + 1]
        if (key == key[0]).all():
            return
        described = {r: _describe(records[r]) for r in range(self.size)}
        groups: dict[str, list[int]] = {}
        for r, text in described.items():
            groups.setdefault(text, []).append(r)
        lines = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}: {text}"
                          for text, rs in groups.items())
        if explain is not None and not records[:, _BAD].any():
            lines += explain()
        raise CollectiveMismatchError(
            f"rank {self.rank}: ranks disagree on collective #{int(mine[0])} ({kind.name.lower()} of "
            f"{name!r}): {lines}. Every rank must call the same collectives in the same order with "
            "arrays of the same dtype and shape; no array was modified.",
            described,
        )

    def _exchange(self, record: np.ndarray, kind: _Kind, name: str) -> np.ndarray:
        """Every rank's record, via Allgather, or polled point-to-point messages under a timeout."""
        records = np.empty((self.size, _RECORD), dtype=np.int64)
        if self.options.timeout is None:
            self._call("agreement", self._comm.Allgather, record, records)
            return records
        what = f"{kind.name.lower()} of {name!r}"
        records[self.rank] = record
        peers = [r for r in range(self.size) if r != self.rank]
        recvs = [self._call("agreement", self._comm.Irecv, records[r], r, _TAG_AGREE) for r in peers]
        sends = [self._call("agreement", self._comm.Isend, record, r, _TAG_AGREE) for r in peers]
        deadline = time.monotonic() + self.options.timeout
        warn_at = time.monotonic() + self.options.timeout / 2
        warned = False
        pause = 0.0
        while not MPI.Request.Testall(recvs):
            now = time.monotonic()
            missing = [r for r, q in zip(peers, recvs) if q != MPI.REQUEST_NULL and not q.Test()]
            if now >= deadline:
                for q in recvs + sends:
                    if q != MPI.REQUEST_NULL:
                        q.Cancel()
                self._broken = f"ranks {format_ranks(missing)} never joined {what} (collective #{self._seq})"
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} did not "
                    f"join {what} (collective #{self._seq}) within {self.options.timeout:g} s. A rank that "
                    "skips a collective, calls a different one, or died leaves the others waiting; every "
                    "rank must call the same collectives in the same order.", missing)
            if not warned and now >= warn_at and missing:
                warned = True
                warnings.warn(f"mpidist rank {self.rank}: still waiting for rank(s) {format_ranks(missing)} "
                              f"to join {what} (collective #{self._seq}) after {self.options.timeout / 2:g} s",
                              RuntimeWarning, stacklevel=4)
            pause = min(1e-3, pause * 2 or 1e-6)
            time.sleep(pause)
        MPI.Request.Waitall(sends)
        return records

    def _wait(self, requests: list[MPI.Request], what: str) -> None:
        """Complete ``requests``, polling against the timeout when one is set."""
        if self.options.timeout is None:
            try:
                MPI.Request.Waitall(requests)
            except MPI.Exception as exc:
                raise CommError(f"rank {self.rank}: {what} failed in MPI: {exc.Get_error_string()}") from exc
            return
        deadline = time.monotonic() + self.options.timeout
        pause = 0.0
        while not MPI.Request.Testall(requests):
            if time.monotonic() >= deadline:
                self._broken = f"{what} (collective #{self._seq}) never completed"
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {what} (collective #{self._seq}) did not complete within "
                    f"{self.options.timeout:g} s although every rank had joined it; a rank may have died")
            pause = min(1e-3, pause * 2 or 1e-6)
            time.sleep(pause)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except MPI.Exception as exc:
            raise CommError(f"rank {self.rank}: MPI error in {what}: {exc.Get_error_string()}") from exc

    def _start(self, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> MPI.Request:
        """Start the nonblocking form of an MPI collective (``Allreduce`` -> ``Iallreduce``).

        On ``comm`` (default: the private duplicate; the hierarchy passes its sub-communicators).
        """
        return self._call(mpi_name, getattr(comm or self._comm, "I" + mpi_name.lower()), *args)

    def _run(self, what: str, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> None:
        """Run an MPI collective to completion (on ``comm``, default the private duplicate).

        Without a timeout this is the blocking call (MPI libraries tune those
        best); with one, the nonblocking form polled against the deadline.
        """
        if self.options.timeout is None:
            self._call(what, getattr(comm or self._comm, mpi_name), *args)
        else:
            self._wait([self._start(mpi_name, *args, comm=comm)], what)
