"""Typed collectives on NumPy/CuPy arrays over a private MPI communicator.

A :class:`Communicator` owns a duplicate of the user's communicator, so its
traffic never mixes with the user's own messages. Every method documented as
*collective* must be called by every rank of the communicator, in the same
order, with compatible arguments.

Before each collective the ranks agree on the call (:mod:`~mpidist._comm.agreement`);
a disagreement raises :class:`~mpidist.CollectiveMismatchError` on every rank
before any data moves, and with a timeout the waiting ranks name the ranks that
never arrived (:class:`~mpidist.CollectiveTimeoutError`). Arrays always travel
as buffers, never pickled (:mod:`~mpidist._comm.transport`); large reductions
run in cache-sized pieces; many arrays reduce together through
:mod:`~mpidist._comm.fusion`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from mpidist._comm.agreement import Agreement, Kind
from mpidist._comm.backend import Backend, array_module
from mpidist._comm.cuda_aware import resolve_cuda_aware
from mpidist._comm.fusion import Fusion, UpdateFn
from mpidist._comm.handle import Handle
from mpidist._comm.hierarchy import node_split
from mpidist._comm.reduce_op import ReduceOp
from mpidist._comm.transport import Transport
from mpidist._errors import CommError
from mpidist._options import Options

__all__ = ["Communicator", "Handle", "duplicate_world"]


def duplicate_world() -> MPI.Intracomm:
    """Collective over ``MPI.COMM_WORLD``: a new duplicate of it (the caller frees it)."""
    return MPI.COMM_WORLD.Dup()


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
        try:
            self._comm = base.Dup()
            self._node = node_split(self._comm)
            self._num_nodes = self._comm.allreduce(int(self._node.rank == 0))
            self._transport = Transport(self._comm, self.options)
        except MPI.Exception as exc:
            raise CommError(f"could not set up mpidist's communicator: {exc.Get_error_string()}") from exc
        self._agreement = Agreement(self._transport)
        self.rank: int = self._comm.rank
        self.size: int = self._comm.size
        self.local_rank: int = self._node.rank
        self.local_size: int = self._node.size
        self.backend = backend if backend is not None else Backend.select(self.options.device, self.local_rank)
        self.cuda_aware = resolve_cuda_aware(self._comm, self.backend, self.options.cuda_aware)
        self._fusion = Fusion(self._transport, self._agreement, self.backend, self.cuda_aware)

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
        if self._node != MPI.COMM_NULL:
            self._node.Free()
        self._transport.free()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._transport.broken is None:
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
        self._agreement.agree(Kind.REDUCE_SCATTER, array, op, name=name)
        rows = array.shape[0] if array.ndim else 1
        counts = self.split_counts(rows) if counts is None else [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != rows or min(counts) < 0:
            raise ValueError(f"rank {self.rank}: reduce_scatter of {name!r}: counts {counts} must be "
                             f"{self.size} non-negative numbers adding up to {rows} rows")
        row = int(np.prod(array.shape[1:], dtype=np.int64)) if array.ndim else 1
        result = array_module(array).empty((counts[self.rank],) + tuple(array.shape[1:]), dtype=array.dtype)
        send = self.backend.to_mpi(array, self.cuda_aware)
        recv = self.backend.to_mpi(result, self.cuda_aware, reuse=False)
        self._transport.run(f"reduce_scatter of {name!r}", "Reduce_scatter", send, recv,
                  [c * row for c in counts], self._transport.mpi_op(op, array.dtype))
        self.backend.from_mpi(result, recv)
        if op is ReduceOp.MEAN:
            result /= self.size
        return result

    def barrier(self) -> None:
        """Collective: return once every rank has entered (honours the timeout)."""
        if self._agreement.enabled:
            self._agreement.agree(Kind.BARRIER, None, None, name="barrier")  # the exchange itself synchronises
            return
        self._transport.begin()
        self._transport.run("barrier", "Barrier")

    def split_counts(self, n: int) -> list[int]:
        """Local: ``n`` items split as evenly as possible over the ranks, lower ranks first."""
        base, extra = divmod(n, self.size)
        return [base + (1 if r < extra else 0) for r in range(self.size)]

    # -- many arrays at once ------------------------------------------------------------
    def reduce_apply(self, sends: Sequence[Any], targets: Sequence[Any], ops: Sequence[Optional[ReduceOp]],
                     fn: UpdateFn, names: Sequence[str], in_place: bool = False) -> None:
        """Collective: ``fn(targets[i], reduced sends[i])`` for every ``i``, fused.

        ``ops[i]`` ``None`` means rank 0's value. ``fn`` updates its first
        argument in place, elementwise: it is called on flat slices, possibly
        spanning several targets that lie back to back, with the reduced
        values in a scratch buffer it must not keep. ``MEAN`` divides before
        ``fn`` sees the values. With ``in_place`` the sends are overwritten
        with their reduced values (no scratch copy); otherwise they are left
        as they are. Every rank passes arrays of the same dtypes and shapes in
        the same order; the ranks agree on the whole list with one record.
        """
        self._fusion.reduce_apply(sends, targets, ops, fn, names, in_place)

    def allreduce_many(self, arrays: Sequence[Any], op: Union[ReduceOp, str] = ReduceOp.SUM,
                       names: Optional[Sequence[str]] = None) -> list[Any]:
        """Collective: every array reduced by ``op``, as new arrays; the inputs are left as they are.

        Small arrays share MPI calls through a reusable bucket; one agreement
        record covers the whole list.
        """
        return self._fusion.allreduce_many(arrays, ReduceOp.of(op), _names(names, len(arrays)))

    def iallreduce_many(self, arrays: Sequence[Any], op: Union[ReduceOp, str] = ReduceOp.SUM,
                        names: Optional[Sequence[str]] = None,
                        then: Callable[[list[Any]], Any] = list) -> Handle:
        """Collective, nonblocking :meth:`allreduce_many`: ``wait()`` returns ``then(list of results)``.

        The inputs are copied when the call starts, so they may change afterwards.
        """
        return self._fusion.iallreduce_many(arrays, ReduceOp.of(op), _names(names, len(arrays)), then)

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
        self._agreement.agree(Kind.ALLREDUCE, array, op, name=name, check_finite=self.options.check_finite)
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
        mpi_op = self._transport.mpi_op(op, array.dtype)
        if (blocking and recv is target and self.options.timeout is None and self._transport.hierarchy is None
                and target.nbytes <= self.options.pipeline_bytes):
            # the common small host case: one call, no pieces (this is the per-update latency path)
            self._transport.call("allreduce", self._comm.Allreduce, MPI.IN_PLACE if send is None else send, target, mpi_op)
            if op is ReduceOp.MEAN:
                target[...] /= self.size
            return target

        flat_send = None if send is None else send.reshape(-1)
        flat_recv, flat_target = recv.reshape(-1), target.reshape(-1)
        pieces = [(None if send is None else flat_send[lo:hi], flat_recv[lo:hi]) for lo, hi in self._transport.pieces(target)]
        what = f"allreduce of {name!r}"
        if not blocking:
            def finish() -> Any:
                self.backend.from_mpi(target, recv)
                if op is ReduceOp.MEAN:
                    target[...] /= self.size
                return target

            requests, complete = self._transport.start_pieces(what, pieces, mpi_op)
            return Handle(self._transport, what, requests, lambda: (complete(), finish())[1])
        staged = recv is not target
        for (sbuf, rbuf), (lo, hi) in zip(pieces, self._transport.pieces(target)):
            self._transport.reduce(what, sbuf, rbuf, mpi_op)
            if op is ReduceOp.MEAN and not staged:
                flat_target[lo:hi] /= self.size  # while the piece is in cache
        self.backend.from_mpi(target, recv)
        if op is ReduceOp.MEAN and staged:
            target[...] /= self.size
        return target

    def _broadcast(self, array: Any, root: int, name: str, blocking: bool) -> Any:
        if not 0 <= root < self.size:
            raise ValueError(f"rank {self.rank}: broadcast of {name!r}: root {root} is not a rank of a "
                             f"{self.size}-rank communicator")
        self._agreement.agree(Kind.BROADCAST, array, None, root=root, name=name)
        buf = self.backend.to_mpi(array, self.cuda_aware, reuse=blocking)

        def finish() -> Any:
            self.backend.from_mpi(array, buf)
            return array

        what = f"broadcast of {name!r}"
        args = (buf.reshape(-1), root)
        if not blocking:
            return Handle(self._transport, what, [self._transport.start("Bcast", *args)] if array.size else [], finish)
        if array.size:
            self._transport.run(what, "Bcast", *args)
        return finish()

    def _allgather(self, array: Any, name: str, blocking: bool) -> Any:
        records = self._agreement.agree(Kind.ALLGATHER, array, None, name=name)
        shape = tuple(array.shape) if array.ndim else (1,)
        if records is None:  # no agreement exchange: gather the lengths alone
            lengths = np.array(self._transport.call("allgather", self._comm.allgather, shape[0]), dtype=np.int64)
        else:
            lengths = self._agreement.allgather_lengths(records)
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
            return Handle(self._transport, what, [self._transport.start("Allgatherv", *args)], finish)
        self._transport.run(what, "Allgatherv", *args)
        return finish()

    def _check_out(self, array: Any, out: Any, name: str) -> None:
        if getattr(out, "shape", None) != array.shape or getattr(out, "dtype", None) != array.dtype:
            raise ValueError(f"rank {self.rank}: allreduce of {name!r}: out= must have the input's shape "
                             f"{tuple(array.shape)} and dtype {array.dtype}, got "
                             f"{getattr(out, 'shape', '?')} {getattr(out, 'dtype', type(out).__name__)}")
        if not out.flags.c_contiguous:
            raise TypeError(f"rank {self.rank}: allreduce of {name!r}: out= must be C-contiguous")


def _names(names: Optional[Sequence[str]], n: int) -> Sequence[str]:
    return [f"array[{i}]" for i in range(n)] if names is None else names
