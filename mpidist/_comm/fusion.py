"""Fused reductions of many arrays: one agreement record, few MPI calls, no full-size temporaries.

Part of the comm layer, next to :mod:`mpidist._comm.communicator` (it drives a
:class:`~mpidist._comm.communicator.Communicator`); it knows nothing of variables. Two
collective operations:

- :meth:`Fusion.reduce_apply` reduces each array and hands the result, piece
  by piece, to an update function (``target += reduced``), while the piece is
  in cache. Arrays that lie back to back in memory (flat storage, see
  :mod:`mpidist._comm.flat`), together with their targets, are reduced where they
  are as one span; other arrays of at most ``options.fusion_bytes`` are packed
  into a reusable bucket of ``options.pipeline_bytes``, one MPI call per
  bucket; larger ones are reduced where they are, in pieces. The only
  temporary is one bucket per dtype, reused across calls: the arrays passed in
  are never modified.
- :meth:`Fusion.allreduce_many` returns new arrays, through ``reduce_apply``;
  the nonblocking :meth:`Fusion.iallreduce_many` returns views of one new
  buffer per dtype, reduced in pieces that stay in flight together.

Every rank must pass arrays of the same dtypes and shapes, in the same order,
with the same ops. The ranks agree on all of them with one record (a digest
of the whole list); when they differ, a second exchange names the first
array that differs. ``op`` ``None`` means rank 0's value (a broadcast).
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mpidist._comm.backend import array_module, is_device_array
from mpidist._comm.communicator import _BAD, _DIMS, _FLOATS, _KIND, _NDIM, _NONFINITE, _RECORD, _SEQ, _Bad, _Kind
from mpidist._comm.communicator import Communicator, Handle, _local_error
from mpidist._errors import format_ranks
from mpidist._comm.flat import joinable, span
from mpidist._comm.reduce_op import ReduceOp

__all__ = ["Fusion"]

Op = Optional[ReduceOp]  # None: rank 0's value
UpdateFn = Callable[[Any, Any], Any]


class Fusion:
    """Fused reductions over ``comm``; holds the reusable buckets (one per array module and dtype).

    Local construction. Every method is collective over ``comm``.
    """

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._buckets: dict[tuple[type, np.dtype], Any] = {}

    # -- reduce and apply ------------------------------------------------------------
    def reduce_apply(self, sends: Sequence[Any], targets: Sequence[Any], ops: Sequence[Op], fn: UpdateFn,
                     names: Sequence[str], in_place: bool = False) -> None:
        """Collective: ``fn(targets[i], reduced sends[i])`` for every ``i``, fused.

        ``fn`` must update its first argument in place, elementwise: it is
        called on flat (1-D) slices of targets, possibly spanning several
        targets that lie back to back, with the reduced values of the
        matching elements in a scratch buffer it must not keep. ``MEAN``
        divides by the number of ranks before ``fn`` sees the values. With
        ``in_place`` the sends are overwritten with their reduced values
        (arrays reduced where they are need no bucket then: the fastest path
        for large buffers); without, they are left as they are.
        """
        what = self._agree(sends, ops, names)
        if len(sends) == 1:  # the per-update latency path
            self._stream(what, sends[0].reshape(-1), targets[0].reshape(-1), ops[0], fn, in_place)
            return
        limit = min(self._comm.options.fusion_bytes, self._comm.options.pipeline_bytes)
        for op, members in self._groups(sends, ops):
            bucket: list[tuple[Any, Any]] = []
            used = 0
            for send, target in _runs([sends[i] for i in members], [targets[i] for i in members]):
                if send.nbytes > limit:  # large: reduce it where it is
                    self._stream(what, send, target, op, fn, in_place)
                    continue
                if used + send.nbytes > self._comm.options.pipeline_bytes:
                    self._flush(what, bucket, op, fn, in_place)
                    bucket, used = [], 0
                bucket.append((send, target))
                used += send.nbytes
            self._flush(what, bucket, op, fn, in_place)

    def _stream(self, what: str, send: Any, target: Any, op: Op, fn: UpdateFn, in_place: bool) -> None:
        """Reduce the flat ``send`` piece by piece (into the bucket, or where it is), applying ``fn`` after each."""
        bucket = self._bucket(send)
        step = bucket.size
        if send.size <= step:  # one piece: the common case of small arrays, kept short
            fn(target, self._transfer(what, None, send, op) if in_place else
               self._transfer(what, send, bucket[:send.size], op))
            return
        for lo in range(0, send.size, step):
            hi = min(lo + step, send.size)
            fn(target[lo:hi], self._transfer(what, None, send[lo:hi], op) if in_place else
               self._transfer(what, send[lo:hi], bucket[:hi - lo], op))

    def _flush(self, what: str, runs: list[tuple[Any, Any]], op: Op, fn: UpdateFn, in_place: bool) -> None:
        """Pack ``runs`` (flat sends and targets, together at most one bucket) and reduce them with one call."""
        if len(runs) <= 1:
            for send, target in runs:
                self._stream(what, send, target, op, fn, in_place)
            return
        bucket = self._bucket(runs[0][0])
        offset = 0
        for send, _ in runs:
            bucket[offset:offset + send.size] = send
            offset += send.size
        reduced = self._transfer(what, None, bucket[:offset], op)
        offset = 0
        for send, target in runs:
            fn(target, reduced[offset:offset + send.size])
            if in_place:
                send[...] = reduced[offset:offset + send.size]
            offset += send.size

    # -- reductions that return new arrays -------------------------------------------------
    def allreduce_many(self, arrays: Sequence[Any], op: ReduceOp, names: Sequence[str]) -> list[Any]:
        """Collective: every array reduced by ``op``, as new arrays; the inputs are left as they are.

        The reduction runs as :meth:`reduce_apply` into one new array per
        input: small arrays share MPI calls through the reusable bucket.
        (Separate results rather than views of one large new buffer: memory
        allocators recycle arrays of ordinary sizes, while a fresh buffer of
        the whole size would be faulted in page by page on every call.)
        """
        results = [array_module(a).empty_like(a) for a in arrays]
        self.reduce_apply(arrays, results, [op] * len(arrays), _assign, names)
        return results

    def iallreduce_many(self, arrays: Sequence[Any], op: ReduceOp, names: Sequence[str],
                        then: Callable[[list[Any]], Any] = list) -> Handle:
        """Collective, nonblocking :meth:`allreduce_many`: ``wait()`` returns ``then(list of results)``.

        The inputs are copied when the call starts, so they may change
        afterwards; the pieces advance while this rank is inside MPI (see
        :meth:`Communicator.iallreduce`).
        """
        comm = self._comm
        what = self._agree(arrays, [op] * len(arrays), names)
        results: list[Any] = [None] * len(arrays)
        requests: list[Any] = []
        steps: list[Callable[[], None]] = []
        for _, members in self._groups(arrays, [op] * len(arrays)):
            out = self._outputs(arrays, members, results)
            for i in members:
                results[i][...] = arrays[i]
            host = comm.backend.to_mpi(out, comm.cuda_aware, reuse=False)
            started, complete = comm._start_pieces(
                what, [(None, host[lo:hi]) for lo, hi in comm._pieces(host)], comm._mpi_op(op, out.dtype))
            requests += started

            def step(out: Any = out, host: Any = host, complete: Callable[[], None] = complete) -> None:
                complete()
                comm.backend.from_mpi(out, host)
                if op is ReduceOp.MEAN:
                    out /= comm.size

            steps.append(step)

        def finish() -> list[Any]:
            for step in steps:
                step()
            return then(results)

        return Handle(comm, what, requests, finish)

    # -- shared parts ---------------------------------------------------------------------
    def _outputs(self, arrays: Sequence[Any], members: list[int], results: list[Any]) -> Any:
        """A new flat buffer for ``arrays[members]``; fills ``results[members]`` with views of it."""
        first = arrays[members[0]]
        out = array_module(first).empty(sum(arrays[i].size for i in members), dtype=first.dtype)
        offset = 0
        for i in members:
            results[i] = out[offset:offset + arrays[i].size].reshape(arrays[i].shape)
            offset += arrays[i].size
        return out

    def _bucket(self, like: Any) -> Any:
        """The reusable bucket for ``like``'s module and dtype: ``options.pipeline_bytes`` (at least one element)."""
        key = (type(like), like.dtype)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = array_module(like).empty(max(1, self._comm.options.pipeline_bytes // like.itemsize), dtype=like.dtype)
            self._buckets[key] = bucket
        return bucket

    def _transfer(self, what: str, send: Any, buf: Any, op: Op) -> Any:
        """One MPI call: the reduction of every rank's ``send`` (``buf`` if ``None``); returns where it is.

        The result is in ``buf``, except for ``op`` ``None`` on rank 0, which
        keeps its own ``send``.
        """
        comm = self._comm
        backend = comm.backend
        if op is None:
            source = send if send is not None and comm.rank == 0 else buf
            host = backend.to_mpi(source, comm.cuda_aware)
            comm._run(what, "Bcast", host, 0)
            if source is buf:
                backend.from_mpi(buf, host)
            return source
        mpi_op = comm._mpi_op(op, buf.dtype)
        if not is_device_array(buf):
            comm._reduce(what, send, buf, mpi_op)
        else:
            if send is not None and backend.needs_staging(buf, comm.cuda_aware):
                buf[...] = send  # stage one buffer, reduced in place
                send = None
            host = backend.to_mpi(buf, comm.cuda_aware)
            comm._reduce(what, send, host, mpi_op)
            backend.from_mpi(buf, host)
        if op is ReduceOp.MEAN:
            buf /= comm.size
        return buf

    @staticmethod
    def _groups(arrays: Sequence[Any], ops: Sequence[Op]) -> list[tuple[Op, list[int]]]:
        """Indices of ``arrays`` grouped by (dtype, op), groups and members in order of first appearance."""
        groups: dict[tuple[str, Op], list[int]] = {}
        for i, (a, op) in enumerate(zip(arrays, ops)):
            groups.setdefault((a.dtype.str, op), []).append(i)
        return [(key[1], members) for key, members in groups.items()]

    def _agree(self, arrays: Sequence[Any], ops: Sequence[Op], names: Sequence[str]) -> str:
        """Collective: validate locally and agree on the whole list with one record; returns its description."""
        comm = self._comm
        if len(arrays) == 1:
            kind = _Kind.BROADCAST if ops[0] is None else _Kind.ALLREDUCE
            comm._agree(kind, arrays[0], ops[0], name=names[0],
                        check_finite=comm.options.check_finite and ops[0] is not None)
            return ("broadcast of " if ops[0] is None else "allreduce of ") + repr(names[0])
        what = f"fused reduction of {len(arrays)} arrays ({_names(names)})"
        seq = comm._begin()
        bad, message = _Bad.OK, ""
        for a, op, name in zip(arrays, ops, names):
            bad, message = comm._validate(a, op, name)
            if bad:
                break
        check_finite = comm.options.check_finite
        if not (comm._agreement_on() or check_finite):
            if bad:
                raise _local_error(bad, message)
            return what
        layout = [] if bad else [_describe(a, op, name) for a, op, name in zip(arrays, ops, names)]
        record = np.zeros(_RECORD, dtype=np.int64)
        record[_SEQ], record[_KIND], record[_NDIM], record[_BAD] = seq, _Kind.FUSED, len(arrays), bad
        record[_DIMS] = zlib.crc32("\n".join(f"{op} {a.dtype.str}{a.shape}" for a, op in zip(arrays, ops)).encode()
                                   ) if not bad else 0
        record[_DIMS + 1] = sum(int(a.size) for a in arrays) if not bad else 0
        if check_finite and not bad:
            record[_NONFINITE] = any(not bool(array_module(a).isfinite(a).all())
                                     for a, op in zip(arrays, ops) if op is not None and a.dtype.char in _FLOATS)

        def explain() -> str:
            tables = [t.decode().split("\n") for t in comm.allgather_bytes("\n".join(layout).encode(),
                                                                            name="fused layout")]
            for i in range(max(len(t) for t in tables)):
                column: dict[str, list[int]] = {}
                for r, table in enumerate(tables):
                    column.setdefault(table[i] if i < len(table) else "(no such array)", []).append(r)
                if len(column) > 1:
                    return (f"; first difference at array #{i}: " +
                            "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}: {text}"
                                      for text, rs in column.items()))
            return ""

        comm._settle(_Kind.FUSED, record, bad, message, what, explain)
        return what


def _assign(target: Any, reduced: Any) -> None:
    target[...] = reduced


def _describe(array: Any, op: Op, name: str) -> str:
    how = "rank 0's value" if op is None else op.value
    return f"{name!r} {how} {array.dtype.name}{list(array.shape)}"


def _names(names: Sequence[str], shown: int = 3) -> str:
    listed = ", ".join(repr(n) for n in names[:shown])
    return listed + (f", ... {len(names) - shown} more" if len(names) > shown else "")


def _runs(sends: Sequence[Any], targets: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Flat (send, target) spans: consecutive pairs whose sends and targets both lie back to back join."""
    runs: list[tuple[Any, Any]] = []
    start = 0
    for i in range(1, len(sends) + 1):
        if i < len(sends) and joinable(sends[i - 1], sends[i]) and joinable(targets[i - 1], targets[i]):
            continue
        runs.append((span(sends[start:i]), span(targets[start:i])))
        start = i
    return runs
