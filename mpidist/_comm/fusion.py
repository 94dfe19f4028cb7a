"""Fused reductions of many arrays: one agreement record, few MPI calls, no full-size temporaries.

Part of the comm layer: the :class:`~mpidist.Communicator`'s
``reduce_apply``, ``allreduce_many`` and ``iallreduce_many`` run here, over
its transport and agreement; it knows nothing of variables. Two collective
operations:

- :meth:`Fusion.reduce_apply` reduces each array and hands the result, piece
  by piece, to an update function (``target += reduced``), while the piece is
  in cache. Arrays that lie back to back in memory (flat storage, see
  :mod:`mpidist._comm.flat_store`), together with their targets, are reduced
  where they are as one span; other arrays of at most ``options.fusion_bytes``
  are packed into a reusable bucket of ``options.piece_bytes``, one MPI call
  per bucket; larger ones are reduced where they are, in pieces. The only
  temporary is one bucket per dtype, reused across calls: the arrays passed in
  are never modified.
- :meth:`Fusion.allreduce_many` returns new arrays, through ``reduce_apply``;
  the nonblocking :meth:`Fusion.iallreduce_many` returns views of one new
  buffer per dtype, reduced in pieces that stay in flight together.

Every rank must pass arrays of the same dtypes and shapes, in the same order,
with the same ops. The ranks agree on all of them with one record (a digest
of the whole list); when they differ, a second exchange names the first
array that differs. ``op`` ``None`` means rank 0's value (a broadcast).
Each MPI call's reduction algorithm is the one
:meth:`~mpidist._comm.algorithms.Algorithms.choose` picks for its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from mpidist._comm import overflow
from mpidist._comm.agreement import Agreement, Call, Kind, carried as in_record, update_identity, validate, validate_out
from mpidist._comm.algorithms import Algorithms
from mpidist._comm.backend import HALF_FLOATS, Backend, array_module, data_pointer, is_device_array
from mpidist._comm.compression import Compression, applies as compressed, wire_error, wire_of
from mpidist._comm.flat_store import joinable, span
from mpidist._comm.half import Widening
from mpidist._comm.handle import Handle
from mpidist._comm.reduce_op import ReduceOp, divide_in_place
from mpidist._comm.transport import Transport
from mpidist._errors import on_rank

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Fusion", "UpdateFn"]

Op = Optional[ReduceOp]  # None: rank 0's value
UpdateFn = Callable[["Array", "Array"], Any]  # fn(target, reduced values), see Fusion.reduce_apply


class Fusion:
    """Fused reductions over ``transport``; holds the reusable buckets (one per array module and dtype).

    Local construction. Every method is collective over the transport's communicator. 16-bit floats
    are reduced through float32 by ``widening`` (:mod:`~mpidist._comm.half`); compressed float32
    reductions by ``compression`` (:mod:`~mpidist._comm.compression`).
    """

    def __init__(
        self,
        transport: Transport,
        agreement: Agreement,
        algorithms: Algorithms,
        backend: Backend,
        cuda_aware: bool,
        widening: Widening,
        compression: Compression,
    ) -> None:
        self._transport = transport
        self._widening = widening
        self._compression = compression
        self._agreement = agreement
        self._choose = algorithms.choose
        self._backend = backend
        self._cuda_aware = cuda_aware
        self._options = transport.options
        self._ranks = np.array(float(transport.size))  # what a carried MEAN divides by (rebuilt after a failure)
        self._buckets: dict[tuple[type, np.dtype], Array] = {}
        self._scratch: dict[tuple[type, np.dtype, str], Array] = {}  # whole-call buffers, per use (scratch)
        if self._options.fault_tolerance:  # an update lands whole or not at all (nothing changes when off)
            self.reduce_apply = self._reduce_apply_whole  # type: ignore[method-assign]

    # -- reduce and apply ------------------------------------------------------------
    def reduce_apply(
        self,
        sends: Sequence[Array],
        targets: Sequence[Array],
        ops: Sequence[Op],
        fn: UpdateFn,
        names: Sequence[str],
        in_place: bool = False,
        error: Optional[Exception] = None,
        compression: Optional[str] = None,
    ) -> None:
        """Collective: ``fn(targets[i], reduced sends[i])`` for every ``i``, fused.

        ``fn`` must update its first argument in place, elementwise: it is
        called on flat (1-D) slices of targets, possibly spanning several
        targets that lie back to back, with the reduced values of the
        matching elements in a scratch buffer it must not keep. ``MEAN``
        divides by the number of ranks before ``fn`` sees the values. With
        ``in_place`` the sends are overwritten with their reduced values
        (arrays reduced where they are need no bucket then: the fastest path
        for large buffers); without, they are left as they are. ``error`` is
        this rank's own problem with its arguments (raised here once every rank
        has seen it; the others raise a mismatch naming this rank).
        ``compression``: see :meth:`~mpidist.Communicator.allreduce`; asked for
        here, every array must be a float32 SUM or MEAN.
        """
        wire = self._options.compression
        if compression is not None:  # asked for on this call: checked here, and agreed as part of the call
            wire, wrong = wire_of(compression, wire, self._transport.rank)
            error = (
                error
                or wrong
                or self._error(sends, ops, names)
                or wire_error(wire, sends, ops, names, self._transport.rank, _what(sends, ops, names))
            )
        single = len(sends) == 1
        if self._options.check_overflow and (
            overflow.applies(ops[0], sends[0].dtype)
            if single
            else any(overflow.applies(op, a.dtype) for a, op in zip(sends, ops))
        ):
            what = _what(sends, ops, names)
            self._agree(
                sends,
                ops,
                names,
                fn,
                error,
                lambda carried: self._checked_apply(what, sends, targets, ops, fn, names, in_place, carried, wire),
                wire,
            )
            return
        if single and error is None:
            send, op = sends[0], ops[0]
            if validate(send, op, names[0], self._transport.rank) is None:  # the per-update path, kept short
                if self._agreement.enabled:
                    carried = self._agreement.agree_array(
                        Kind.BROADCAST if op is None else Kind.ALLREDUCE,
                        names[0],
                        op,
                        send,
                        self._options.check_finite and op is not None,
                        None if fn in _OUTPUTS else fn,
                        wire if wire is not None and compressed(wire, op, send.dtype) else None,
                    )
                else:  # every check off: straight to the data
                    self._transport.begin()
                    carried = None
                if carried is None:
                    self._stream(
                        _what(sends, ops, names), send.reshape(-1), targets[0].reshape(-1), op, fn, in_place, wire
                    )
                    return
                self._apply_carried(carried, send, targets[0], op, fn, in_place)
                return
        what = _what(sends, ops, names)

        def then(carried: Optional[np.ndarray]) -> None:
            if carried is not None:  # one small array, reduced inside the agreement itself
                self._apply_carried(carried.reshape(sends[0].shape), sends[0], targets[0], ops[0], fn, in_place)
            else:
                self._reduce_apply(what, sends, targets, ops, fn, in_place, wire)

        self._agree(sends, ops, names, fn, error, then, wire)

    def _apply_carried(
        self, carried: np.ndarray, send: Array, target: Array, op: Op, fn: UpdateFn, in_place: bool
    ) -> None:
        """Local: ``fn(target, reduced)`` from the float64 sums the agreement carried (shaped like ``send``)."""
        reduced = self._reduced(carried, op, send.dtype)
        fn(target, reduced)  # shaped like the send, as the target is
        if in_place:
            send[...] = reduced

    def _reduced(self, carried: np.ndarray, op: Op, dtype: np.dtype) -> np.ndarray:
        """Local: the float64 sums the agreement carried, as reduced values of ``dtype`` (``MEAN``: divided)."""
        if op is ReduceOp.MEAN:
            carried = carried / self._ranks  # a 0-d array: half the time of dividing by an int
        char = dtype.char
        return carried if char == "d" else carried.astype(dtype) if char == "f" else _cast(carried, dtype)

    def prepare(self, like: Array, op: Op, fn: UpdateFn, name: str) -> Optional[Callable[[Array, Array], None]]:
        """Local: a function ``update(send, target)`` that does ``reduce_apply((send,), (target,), (op,), fn,
        (name,))`` on the short path, or ``None`` where such calls take another.

        For the calls one variable's updates make over and over: every
        ``send`` and ``target`` is a host array of ``like``'s class, dtype and
        shape, C-contiguous (the caller's promise), small enough to travel
        inside the agreement record (:func:`~mpidist._comm.agreement.carried`),
        reduced by ``SUM`` or ``MEAN``, neither overflow-checked nor
        compressed. The ranks agree on the same call as ``reduce_apply``'s, so
        ranks on either path pair. Valid as long as this object serves the
        communicator (it is rebuilt after ranks died).
        """
        agreement, options = self._agreement, self._options
        wire = options.compression
        if (
            not agreement.enabled
            or fn in _OUTPUTS
            or validate(like, op, name, self._transport.rank) is not None
            or not in_record(like, op)
            or (options.check_overflow and overflow.applies(op, like.dtype))
            or (wire is not None and compressed(wire, op, like.dtype))
        ):
            return None
        plan = agreement.plan_array(Kind.ALLREDUCE, name, op, like, fn)
        agree, check_finite, reduced, dtype = agreement.agree_planned, options.check_finite, self._reduced, like.dtype

        def update(send: Array, target: Array) -> None:
            carried = agree(plan, send, check_finite)
            assert carried is not None  # the plan carries the data
            fn(target, reduced(carried, op, dtype))

        return update

    def _reduce_apply_whole(
        self,
        sends: Sequence[Array],
        targets: Sequence[Array],
        ops: Sequence[Op],
        fn: UpdateFn,
        names: Sequence[str],
        in_place: bool = False,
        error: Optional[Exception] = None,
        compression: Optional[str] = None,
    ) -> None:
        """Collective, with fault tolerance: :meth:`reduce_apply`, whose ``fn`` runs only once every piece arrived.

        Ranks may die between two pieces of a fused update; the survivors must
        then hold each target either as it was or wholly updated, never
        partly, so that :func:`~mpidist._comm.survival` recovery can tell the
        two apart. The reduced values are kept (one copy of the update) and
        applied after the last piece. An update of one array that fits one
        piece is one MPI call before ``fn``: it needs no copy.
        """
        if len(sends) == 1 and sends[0].nbytes <= self._options.piece_bytes:
            Fusion.reduce_apply(self, sends, targets, ops, fn, names, in_place, error, compression)
            return
        later = _Later(fn, self.scratch(sends[0], sum(a.size for a in sends)) if sends else None)
        Fusion.reduce_apply(self, sends, targets, ops, later, names, in_place, error, compression)
        later.apply()

    def _reduce_apply(
        self,
        what: str,
        sends: Sequence[Array],
        targets: Sequence[Array],
        ops: Sequence[Op],
        fn: UpdateFn,
        in_place: bool,
        wire: Optional[str],
    ) -> None:
        if len(sends) == 1:  # the per-update latency path
            self._stream(what, sends[0].reshape(-1), targets[0].reshape(-1), ops[0], fn, in_place, wire)
            return
        limit = min(self._options.fusion_bytes, self._options.piece_bytes)
        for op, members in self._groups(sends, ops):
            bucket: list[tuple[Array, Array]] = []
            used = 0
            for send, target in _spans([sends[i] for i in members], [targets[i] for i in members]):
                if send.nbytes > limit:  # large: reduce it where it is
                    self._stream(what, send, target, op, fn, in_place, wire)
                    continue
                if used + send.nbytes > self._options.piece_bytes:
                    self._flush(what, bucket, op, fn, in_place, wire)
                    bucket, used = [], 0
                bucket.append((send, target))
                used += send.nbytes
            self._flush(what, bucket, op, fn, in_place, wire)

    def _checked_apply(
        self,
        what: str,
        sends: Sequence[Array],
        targets: Sequence[Array],
        ops: Sequence[Op],
        fn: UpdateFn,
        names: Sequence[str],
        in_place: bool,
        carried: Optional[np.ndarray],
        wire: Optional[str],
    ) -> None:
        """:meth:`_reduce_apply` with integer sums checked: every checked sum first, then any write.

        ``carried`` holds the float64 sums of one small array, when the
        agreement carried them (exact for the integers it carries).
        """
        checked = [i for i, (a, op) in enumerate(zip(sends, ops)) if overflow.applies(op, a.dtype)]
        rank = self._transport.rank
        sums = {}
        for i in checked:
            if carried is not None:
                sums[i] = overflow.narrow(carried.reshape(-1), sends[i].dtype, names[i], rank)
            else:
                wide = overflow.widen(sends[i])
                for lo, hi in self._choose(wide.nbytes).pieces(wide):
                    self._transfer(what, None, wide[lo:hi], ReduceOp.SUM, None)  # exact: integers
                sums[i] = overflow.narrow(wide, sends[i].dtype, names[i], rank)
        for i, reduced in sums.items():
            fn(targets[i].reshape(-1), reduced)
            if in_place:
                sends[i].reshape(-1)[...] = reduced
        rest = [i for i in range(len(sends)) if i not in sums]
        if rest:
            self._reduce_apply(
                what, [sends[i] for i in rest], [targets[i] for i in rest], [ops[i] for i in rest], fn, in_place, wire
            )

    def _stream(
        self, what: str, send: Array, target: Array, op: Op, fn: UpdateFn, in_place: bool, wire: Optional[str]
    ) -> None:
        """Reduce the flat ``send`` piece by piece (into the bucket, or where it is), applying ``fn`` after each.

        :func:`_into` (``allreduce_many`` with ``out=``) reduces straight into the target: no scratch copy.
        """
        bucket = self._bucket(send)
        step = bucket.size
        if send.size > step and self._pipeline(what, send, target, op, fn, in_place, wire):
            return
        if fn is _into and op is not None and not in_place:
            alias = data_pointer(send) == data_pointer(target)  # out= is the input itself: reduce it in place
            for lo in range(0, send.size, step):
                self._transfer(what, None if alias else send[lo : lo + step], target[lo : lo + step], op, wire)
            return
        if send.size <= step:  # one piece: the common case of small arrays, kept short
            fn(
                target,
                self._transfer(what, None, send, op, wire)
                if in_place
                else self._transfer(what, send, bucket[: send.size], op, wire),
            )
            return
        for lo in range(0, send.size, step):
            hi = min(lo + step, send.size)
            fn(
                target[lo:hi],
                self._transfer(what, None, send[lo:hi], op, wire)
                if in_place
                else self._transfer(what, send[lo:hi], bucket[: hi - lo], op, wire),
            )

    def _pipeline(
        self, what: str, send: Array, target: Array, op: Op, fn: UpdateFn, in_place: bool, wire: Optional[str]
    ) -> bool:
        """Reduce the flat ``send`` of several pieces by a pipelined algorithm, applying ``fn`` to each piece as it
        lands; False (nothing done) where the pieces' algorithm is not pipelined, or the data is not reduced
        at its own width. A compressed reduction (``wire``) is a pipeline of its own
        (:mod:`~mpidist._comm.compression`), whatever the algorithm.

        The pipeline holds many pieces at once, so they are reduced in the target itself (``out=``), in ``send``
        (``in_place``) or in a reusable copy of ``send`` (:meth:`scratch`), not in the one bucket. Device data
        that MPI is not handed is staged to the host whole and each piece copied back as it lands: where the
        data is never decides the MPI calls, so ranks holding theirs in different places make the same ones.
        """
        if op is None or send.dtype.char in HALF_FLOATS:
            return False
        squeezed = wire if compressed(wire, op, send.dtype) else None  # the call's compression, where it applies
        reduction = self._choose(self._options.piece_bytes)
        if squeezed is None and not reduction.pipelined:
            return False
        apply: Optional[UpdateFn] = fn
        if fn is _into and not in_place:  # out=: reduced where it goes
            if data_pointer(send) != data_pointer(target):
                target[...] = send
            buffer, apply = target, None
        elif in_place:
            buffer = send
        else:
            buffer = self.scratch(send, send.size, "pipeline")[: send.size]
            buffer[...] = send
        if squeezed is not None:  # the compression divides a MEAN and hands each piece over as it lands
            self._compression.reduce(
                what, buffer, op, squeezed, None if apply is None else _landing(apply, target, buffer)
            )
            return True
        backend = self._backend
        host = backend.to_mpi(buffer, self._cuda_aware)
        ranges = reduction.pieces(host)
        size = self._transport.size

        def reduced(k: int) -> None:
            lo, hi = ranges[k]
            backend.from_mpi(buffer[lo:hi], host[lo:hi])
            if op is ReduceOp.MEAN:
                divide_in_place(buffer[lo:hi], size)
            if apply is not None:
                apply(target[lo:hi], buffer[lo:hi])

        mpi_op = self._transport.mpi_op(op, buffer.dtype)
        reduction.reduce_pieces(what, [host[lo:hi] for lo, hi in ranges], mpi_op, reduced)
        return True

    def _flush(
        self, what: str, spans: list[tuple[Array, Array]], op: Op, fn: UpdateFn, in_place: bool, wire: Optional[str]
    ) -> None:
        """Pack ``spans`` (flat sends and targets, together at most one bucket) and reduce them with one call."""
        if len(spans) <= 1:
            for send, target in spans:
                self._stream(what, send, target, op, fn, in_place, wire)
            return
        bucket = self._bucket(spans[0][0])
        offset = 0
        for send, _ in spans:
            bucket[offset : offset + send.size] = send
            offset += send.size
        reduced = self._transfer(what, None, bucket[:offset], op, wire)
        offset = 0
        for send, target in spans:
            fn(target, reduced[offset : offset + send.size])
            if in_place:
                send[...] = reduced[offset : offset + send.size]
            offset += send.size

    # -- reductions that return new arrays -------------------------------------------------
    def allreduce_many(
        self,
        arrays: Sequence[Array],
        op: ReduceOp,
        names: Sequence[str],
        out: Optional[Sequence[Array]] = None,
        compression: Optional[str] = None,
    ) -> list[Any]:
        """Collective: every array reduced by ``op``, into ``out`` or new arrays; the inputs are left as they are.

        The reduction runs as :meth:`reduce_apply` into one array per input:
        small arrays share MPI calls through the reusable bucket. (Separate
        results rather than views of one large new buffer: memory allocators
        recycle arrays of ordinary sizes, while a fresh buffer of the whole
        size would be faulted in page by page on every call.) ``out``, one
        array per input of its shape and dtype (a device array for a device
        input), allocates nothing. ``compression`` as in :meth:`reduce_apply`.
        """
        error = None
        if out is None:
            results = [array_module(a).empty_like(a) for a in arrays]
        else:
            results = list(out)
            error = _out_error(arrays, results, self._transport.rank)
        self.reduce_apply(
            arrays,
            results,
            [op] * len(arrays),
            _assign if out is None else _into,
            names,
            error=error,
            compression=compression,
        )
        return results

    def iallreduce_many(
        self, arrays: Sequence[Array], op: ReduceOp, names: Sequence[str], then: Callable[[list[Any]], Any] = list
    ) -> Handle:
        """Collective, nonblocking :meth:`allreduce_many`: ``wait()`` returns ``then(list of results)``.

        The inputs are copied when the call starts, so they may change
        afterwards; the pieces advance while this rank is inside MPI (see
        :meth:`Communicator.iallreduce`).
        """
        t = self._transport
        if self._options.check_overflow and any(overflow.applies(op, a.dtype) for a in arrays):
            reduced = self.allreduce_many(arrays, op, names)  # checked sums complete before anything is written
            return Handle(t, None, ([], lambda: then(reduced)))
        what = _what(arrays, [op] * len(arrays), names)
        results: list[Any] = [None] * len(arrays)
        copies = []
        for _, members in self._groups(arrays, [op] * len(arrays)):
            out = self._outputs(arrays, members, results)
            for i in members:
                results[i][...] = arrays[i]
            copies.append(out)

        def start(_: Optional[np.ndarray]) -> tuple[list[Any], Callable[[], Any]]:
            requests: list[Any] = []
            steps: list[Callable[[], None]] = []
            for out in copies:
                if out.dtype.char in HALF_FLOATS:  # through float32, rounded once when complete
                    started, complete = self._widening.start(what, out, op)
                    requests += started
                    steps.append(complete)
                    continue
                host = self._backend.to_mpi(out, self._cuda_aware, reuse=False)
                reduction = self._choose(host.nbytes)
                started, complete = reduction.start(
                    what, [host[lo:hi] for lo, hi in reduction.pieces(host)], t.mpi_op(op, out.dtype)
                )
                requests += started

                def step(out: Array = out, host: Array = host, complete: Callable[[], None] = complete) -> None:
                    complete()
                    self._backend.from_mpi(out, host)
                    if op is ReduceOp.MEAN:
                        divide_in_place(out, t.size)

                steps.append(step)

            def finish() -> Any:
                for step in steps:
                    step()
                return then(results)

            return requests, finish

        if not self._agreement.enabled:
            t.begin()
            return Handle(t, None, start(None), keep=tuple(copies))
        ops = [op] * len(arrays)
        ticket = self._agreement.start(
            self._call(arrays, ops, names, None),
            self._error(arrays, ops, names),
            list(arrays),
            self._options.check_finite,
            start,
        )
        return Handle(t, ticket, keep=tuple(copies))

    # -- agreement ------------------------------------------------------------------------
    def _error(self, arrays: Sequence[Array], ops: Sequence[Op], names: Sequence[str]) -> Optional[Exception]:
        """Local: the first invalid argument of the list, or ``None``."""
        for a, op, name in zip(arrays, ops, names):
            error = validate(a, op, name, self._transport.rank)
            if error is not None:
                return error
        return None

    @staticmethod
    def _call(
        arrays: Sequence[Array],
        ops: Sequence[Op],
        names: Sequence[str],
        fn: Optional[UpdateFn],
        wire: Optional[str] = None,
    ) -> Call:
        """What the ranks agree on: one array's own call, or the whole list's layout and names; the update;
        and the compression ``wire``, where it applies to some array of the list.

        The output form (new arrays, ``out=``: :data:`_OUTPUTS`) is not part of it.
        """
        update = None if fn in _OUTPUTS else update_identity(fn)
        if wire is not None and not any(compressed(wire, op, a.dtype) for a, op in zip(arrays, ops)):
            wire = None
        if len(arrays) == 1:
            a = arrays[0]
            kind = Kind.BROADCAST if ops[0] is None else Kind.ALLREDUCE
            return Call(
                kind,
                names[0],
                ops[0],
                a.dtype.char,
                tuple(a.shape),
                extra=None if update is None else (update,),
                wire=wire,
            )
        specs = tuple((None if op is None else op.value, a.dtype.str, tuple(a.shape)) for a, op in zip(arrays, ops))
        return Call(
            Kind.FUSED,
            _what(arrays, ops, names)[len("fused reduction of ") :],
            extra=(specs, tuple(names), update),
            wire=wire,
        )

    def _agree(
        self,
        arrays: Sequence[Array],
        ops: Sequence[Op],
        names: Sequence[str],
        fn: Optional[UpdateFn],
        error: Optional[Exception],
        then: Callable[[Optional[np.ndarray]], None],
        wire: Optional[str],
    ) -> None:
        """Collective: agree on the list (with this rank's ``error``, if any) and its compression ``wire``, then
        run ``then``."""
        error = error or self._error(arrays, ops, names)
        if not self._agreement.enabled:
            self._transport.begin()
            if error is not None:
                raise error
            then(None)
            return
        call = (
            self._call(arrays, ops, names, fn, wire) if error is None else Call(Kind.FUSED, _what(arrays, ops, names))
        )
        data = arrays[0] if len(arrays) == 1 else [a for a, op in zip(arrays, ops) if op is not None]
        self._agreement.start(
            call, error, data, self._options.check_finite and any(op is not None for op in ops), then
        ).wait()

    # -- shared parts ---------------------------------------------------------------------
    def _outputs(self, arrays: Sequence[Array], members: list[int], results: list[Any]) -> Array:
        """A new flat buffer for ``arrays[members]``; fills ``results[members]`` with views of it."""
        first = arrays[members[0]]
        out = array_module(first).empty(sum(arrays[i].size for i in members), dtype=first.dtype)
        offset = 0
        for i in members:
            results[i] = out[offset : offset + arrays[i].size].reshape(arrays[i].shape)
            offset += arrays[i].size
        return out

    def scratch(self, like: Array, size: int, use: str = "whole") -> Array:
        """Local: a reusable flat buffer of ``like``'s module and dtype, of at least ``size`` elements.

        Kept from call to call (grown when too small), so that a call that
        must hold its whole result before it writes it (fault tolerance), or
        a pipelined reduction's copy of its input, touches memory already
        mapped; its contents last until the next ``scratch`` call of the same
        module, dtype and ``use`` (one buffer per use, so that the two can
        be used by one call).
        """
        key = (type(like), like.dtype, use)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.size < size:
            buffer = self._scratch[key] = array_module(like).empty(max(1, size), dtype=like.dtype)
        return buffer

    def _bucket(self, like: Array) -> Array:
        """The reusable bucket for ``like``'s module and dtype: ``options.piece_bytes`` (at least one element)."""
        key = (type(like), like.dtype)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = array_module(like).empty(max(1, self._options.piece_bytes // like.itemsize), dtype=like.dtype)
            self._buckets[key] = bucket
        return bucket

    def _transfer(self, what: str, send: Optional[Array], buf: Array, op: Op, wire: Optional[str]) -> Array:
        """One MPI call: the reduction of every rank's ``send`` (``buf`` if ``None``); returns where it is.

        ``wire``: the call's compression, for the float32 SUM and MEAN it applies to.

        The result is in ``buf``, except for ``op`` ``None`` on rank 0, which
        keeps its own ``send``.
        """
        t, backend = self._transport, self._backend
        if op is None:
            source = send if send is not None and t.rank == 0 else buf
            host = backend.to_mpi(source, self._cuda_aware)
            t.broadcast(what, host, 0)
            if source is buf:
                backend.from_mpi(buf, host)
            return source
        if send is not None:  # reduced in place: the output form never changes the MPI calls
            buf[...] = send  # before to_mpi, which synchronises a device array's stream
        if wire is not None and compressed(wire, op, buf.dtype):  # 16 bits on the wire (MEAN included)
            self._compression.reduce(what, buf, op, wire)
            return buf
        if buf.dtype.char in HALF_FLOATS:  # through float32, rounded once (MEAN included)
            self._widening.reduce(what, buf, op)
            return buf
        mpi_op = t.mpi_op(op, buf.dtype)
        if not is_device_array(buf):
            self._choose(buf.nbytes).reduce(what, buf, mpi_op)
        else:
            host = backend.to_mpi(buf, self._cuda_aware)
            self._choose(buf.nbytes).reduce(what, host, mpi_op)
            backend.from_mpi(buf, host)
        if op is ReduceOp.MEAN:
            divide_in_place(buf, t.size)
        return buf

    @staticmethod
    def _groups(arrays: Sequence[Array], ops: Sequence[Op]) -> list[tuple[Op, list[int]]]:
        """Indices of ``arrays`` grouped by (dtype, op), groups and members in order of first appearance."""
        groups: dict[tuple[str, Op], list[int]] = {}
        for i, (a, op) in enumerate(zip(arrays, ops)):
            groups.setdefault((a.dtype.str, op), []).append(i)
        return [(key[1], members) for key, members in groups.items()]


def _landing(fn: UpdateFn, target: Array, reduced: Array) -> Callable[[int, int], None]:
    """``fn`` applied to the elements ``lo:hi`` of ``target`` and ``reduced``, as a piece lands."""
    return lambda lo, hi: fn(target[lo:hi], reduced[lo:hi])


def _assign(target: Array, reduced: Array) -> None:
    target[...] = reduced


def _into(target: Array, reduced: Array) -> None:
    """:func:`_assign` for targets the caller already uses (``out=``): large ones are reduced into directly.

    Not for new arrays: MPI writing into memory never touched yet (each page
    faulted in by the library) measured several times slower than the copy
    from the bucket.
    """
    target[...] = reduced


# The updates that only store the reduced values (new arrays, out=): output forms, not part of a call.
_OUTPUTS = (_assign, _into)


class _Later:
    """An update ``fn`` deferred: each call keeps a copy of the reduced values; :meth:`apply` runs them all.

    The copies go into ``store`` (a flat buffer, reused from call to call) while it has room, then
    into new arrays (sends of several dtypes). It is identified as ``fn`` itself (its code and name),
    so ranks compare the same update whether they defer it or not.
    """

    def __init__(self, fn: UpdateFn, store: Optional[Array]) -> None:
        self.fn = fn
        self.store, self.used = store, 0
        self.calls: list[tuple[Array, Array]] = []
        if hasattr(fn, "__code__"):  # what update_identity and the agreement's plans read
            self.__code__ = fn.__code__
            self.__qualname__ = getattr(fn, "__qualname__", fn.__code__.co_name)

    def __call__(self, target: Array, reduced: Array) -> None:
        store, used, n = self.store, self.used, reduced.size
        if store is not None and store.dtype == reduced.dtype and used + n <= store.size and reduced.ndim <= 1:
            kept = store[used : used + n]
            kept[...] = reduced
            self.used = used + n
        else:
            kept = reduced.copy()
        self.calls.append((target, kept))

    def apply(self) -> None:
        """Local: every deferred update, in order."""
        for target, reduced in self.calls:
            self.fn(target, reduced)
        self.calls = []


def _spans(sends: Sequence[Array], targets: Sequence[Array]) -> list[tuple[Array, Array]]:
    """Flat (send, target) spans: consecutive pairs whose sends and targets both lie back to back join."""
    spans: list[tuple[Array, Array]] = []
    start = 0
    for i in range(1, len(sends) + 1):
        if i < len(sends) and joinable(sends[i - 1], sends[i]) and joinable(targets[i - 1], targets[i]):
            continue
        spans.append((span(sends[start:i]), span(targets[start:i])))
        start = i
    return spans


def _what(arrays: Sequence[Array], ops: Sequence[Op], names: Sequence[str]) -> str:
    if len(arrays) == 1:
        return ("broadcast of " if ops[0] is None else "allreduce of ") + repr(names[0])
    listed = ", ".join(repr(n) for n in names[:3])
    more = f", ... {len(names) - 3} more" if len(names) > 3 else ""
    return f"fused reduction of {len(arrays)} arrays ({listed}{more})"


def _cast(carried: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The reduced values carried in the record (float64), in the arrays' dtype (integers wrap like MPI's)."""
    if dtype.char == "?":
        return carried != 0
    if dtype.kind in "iu":
        return carried.astype(np.int64).astype(dtype)
    return carried.astype(dtype, copy=False)


def _out_error(arrays: Sequence[Array], out: Sequence[Any], rank: int) -> Optional[Exception]:
    """Local: why ``out`` cannot hold the reductions of ``arrays``, or ``None``."""
    if len(out) != len(arrays):
        return ValueError(on_rank(rank, f"out= holds {len(out)} arrays for {len(arrays)} values"))
    for i, (a, o) in enumerate(zip(arrays, out)):
        error = validate_out(a, o, f"out[{i}]", "the value it receives", rank)
        if error is not None:
            return error
    return None
