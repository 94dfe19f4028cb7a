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
run in cache-sized pieces, each by the algorithm
:meth:`~mpidist._comm.algorithms.Algorithms.choose` picks
(:mod:`~mpidist._comm.algorithms`); many arrays reduce together through
:mod:`~mpidist._comm.fusion`. :meth:`Communicator.outcome` asks whether every
rank succeeded (:mod:`~mpidist._comm.outcome`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Union

import numpy as np
from mpi4py import MPI

from mpidist._comm import overflow
from mpidist._comm.abort import install_exit_hook, leave_alone
from mpidist._comm.agreement import Agreement, Call, Kind, validate, validate_out
from mpidist._comm.algorithms import Algorithms
from mpidist._comm.backend import HALF_FLOATS, Backend, array_module, as_array, is_device_array
from mpidist._comm.call_site import warn_at_caller
from mpidist._comm.compression import Compression, applies as compressed, wire_error, wire_of
from mpidist._comm.cuda_aware import resolve_cuda_aware
from mpidist._comm.exchange import Exchange, mpi_datatype, offsets, send_counts
from mpidist._comm.fusion import Fusion, UpdateFn
from mpidist._comm.half import Widening
from mpidist._comm.handle import Handle
from mpidist._comm.library import library_version
from mpidist._comm.outcome import Failures, describe_failures, gather_failures
from mpidist._comm.reduce_op import ReduceOp, divide_in_place
from mpidist._comm.survival import Progress, failed_ranks, progress, readiness, release, revoke, shrink
from mpidist._comm.timeline import (
    NONBLOCKING,
    TimedAgreement,
    TimedTransport,
    Timeline,
    Track,
    number_communicator,
    open_timeline,
)
from mpidist._comm.topology import Topology, group_split
from mpidist._comm.transport import Transport, duplicate
from mpidist._comm.tuning import tune_at_run_time
from mpidist._errors import CollectiveMismatchError, CommError, CutOffError, RankFailedError, format_ranks, on_rank
from mpidist._options import Options

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["Communicator", "Handle", "describe_failures", "duplicate_world"]


def duplicate_world() -> MPI.Intracomm:
    """Collective over ``MPI.COMM_WORLD``: a new duplicate of it (the caller frees it)."""
    return MPI.COMM_WORLD.Dup()


def _named(exc: OSError, message: str) -> OSError:
    """Local: an error of ``exc``'s class saying ``message`` (which names the rank), with its ``errno``."""
    named = type(exc)(message)
    named.errno = exc.errno
    return named


class Communicator:
    """Collectives on arrays over a private duplicate of an MPI communicator.

    Collective construction: every rank of ``comm`` must create it together.
    Call :meth:`free` (or use it as a context manager) to release it; it is
    never freed from ``__del__``, because garbage collection runs in a
    different order on each rank.

    Array arguments (and ``out=``) are NumPy or CuPy arrays, or other
    libraries' arrays (torch, JAX, ...: ``__dlpack__`` or ``__array__``), which
    are used as NumPy or CuPy views of their memory: what a collective writes in
    place or into ``out=`` lands in the caller's object, and the array it
    returns is such a view. Numbers and lists are refused.

    Args:
        comm: the mpi4py communicator to duplicate (default ``MPI.COMM_WORLD``).
        options: timeouts, checks and sizes (:class:`~mpidist._options.Options`);
            default: from ``MPIDIST_*`` environment variables.
        backend: where arrays live (:class:`~mpidist._comm.backend.Backend`); default:
            chosen by ``options.device``, binding this rank's GPU by its
            node-local rank.

    ``timeline`` is the :class:`~mpidist._comm.timeline.Timeline` this rank
    records the collectives into (``options.timeline``), or ``None``.
    """

    def __init__(
        self,
        comm: Optional[MPI.Comm] = None,
        options: Optional[Options] = None,
        backend: Optional[Backend] = None,
        *,
        overrides: Optional[Mapping[str, Any]] = None,
    ) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm):
            raise TypeError(
                on_rank(
                    None, f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(base).__name__}"
                )
            )
        # What fails on this rank while it is being created is raised on every rank, in the creation's agreement.
        error: Optional[Exception] = None
        if options is None:
            try:
                options = Options.resolve(**(overrides or {}))
            except Exception as exc:  # a bad option or environment variable on one rank
                error, options = exc, Options()
        self.options = options
        self._comm = duplicate(base, options.timeout)
        world = number_communicator(self._comm)  # counted also without a timeline: alike on every rank
        # The timeline this communicator records into (options.timeline), or None: then nothing is recorded.
        self.timeline: Optional[Timeline] = None
        track: Optional[Track] = None
        if options.timeline is not None:
            try:
                self.timeline = open_timeline(options.timeline)
                track = self.timeline.track(self._comm.rank, self._comm.size, world)
            except OSError as exc:  # a directory this rank cannot write: raised on every rank, in the agreement
                error = error or _named(exc, on_rank(self._comm.rank, f"timeline {options.timeline!r}: {exc.strerror}"))
        try:
            self._transport = (
                Transport(self._comm, self.options)
                if track is None
                else TimedTransport(self._comm, self.options, track)
            )
            tune_at_run_time(self._transport)
            self._topology = Topology(self._comm)
        except MPI.Exception as exc:
            raise CommError(
                on_rank(base.rank, f"could not set up mpidist's communicator: {exc.Get_error_string()}")
            ) from exc
        self._agreement = Agreement(self._transport) if track is None else TimedAgreement(self._transport, track)
        self.local_rank: int = self._topology.node.rank
        if error is None and backend is None:
            try:
                backend = Backend.select(self.options.device, self.local_rank)
            except Exception as exc:  # e.g. no GPU on this rank's node
                error = exc
        try:
            self._agreement.agree(Call(Kind.CREATE, "mpidist's communicator", extra=_shared_options(options)), error)
        except BaseException:
            self._agreement.free()
            self._topology.free()
            self._transport.free()
            raise
        assert backend is not None  # else error was set, and the agreement raised it
        self.backend = backend
        install_exit_hook()
        self.cuda_awareness = resolve_cuda_aware(self._comm, self.backend, self.options.cuda_aware)
        self.cuda_aware = self.cuda_awareness.enabled
        self.generation = -1  # counts the builds: what prepare_update made is valid within one
        self._build()
        self._track = track
        if track is not None:
            self._record_nonblocking(track)
        self.last_failure: Optional[Failure] = None
        self.cut_off: Optional[CommError] = None  # this rank's side of a failure stopped (CutOffError)
        # set by an owner that must make the survivors alike before they go on (a strategy: its recover()):
        # after a failure every collective refuses until release_hold()
        self.hold_after_failure = False
        if options.fault_tolerance:
            self._transport.on_peer_failure = self._survive
            self._reduce_data = self._reduce_data_whole  # type: ignore[method-assign]  # nothing changes when off
            ready, why = readiness()
            if not ready and self.rank == 0:
                warn_at_caller(on_rank(0, f"fault_tolerance is on, but dead ranks will {why}"))

    def _record_nonblocking(self, track: Track) -> None:
        """Local: the nonblocking collectives, as this object's own attributes, recorded on ``track``."""
        for method in NONBLOCKING:
            setattr(
                self, method, track.record_nonblocking(getattr(Communicator, method).__get__(self), self._transport)
            )

    def _build(self) -> None:
        """Collective: the algorithms and the collectives' helpers over the private communicator (again after a
        failure, over the survivors')."""
        self.generation += 1
        self._algorithms = Algorithms(self._transport, self._topology, self.cuda_aware)
        self.rank: int = self._comm.rank
        self.size: int = self._comm.size
        self.local_size: int = self._topology.node.size
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._transport.yield_while_waiting = self.local_size > cores and "mpich" in library_version().lower()
        self._widening = Widening(self._transport, self._algorithms, self.backend, self.cuda_aware)
        self._compression = Compression(self._transport, self._algorithms, self.backend, self.cuda_aware)
        self._fusion = Fusion(
            self._transport,
            self._agreement,
            self._algorithms,
            self.backend,
            self.cuda_aware,
            self._widening,
            self._compression,
        )
        self._exchange = Exchange(self._transport, self.backend, self.cuda_aware)
        self._choose = self._algorithms.choose
        self._node_communicator: Optional[Communicator] = None

    # -- surviving dead ranks (fault_tolerance) ------------------------------------------------
    def _survive(self, what: str, exc: MPI.Exception) -> CommError:
        """Collective over the survivors (error path, with ``fault_tolerance``): MPI's ``exc`` in ``what``,
        most likely because ranks died.

        Revokes the private communicator and those split from it (so every
        survivor, wherever it waits, comes here too), shrinks it to the
        survivors, exchanges how far each got, and rebuilds this communicator
        over them; a further failure meanwhile starts again from the shrunk
        communicator. Returns the :class:`~mpidist.RankFailedError` to raise,
        the same failed ranks on every survivor; every handle still in flight
        completed nowhere and raises it too.
        """
        t = self._transport
        begun = time.perf_counter()
        seq, steps, old_rank = t.seq, self._agreement.input_steps, self.rank
        before = self._comm.Get_group()
        handles = list(t.handles)
        t.broken = "ranks died"  # nothing waits on the old communicators any more
        t.on_peer_failure = _again
        comm, dropped = self._comm, self._drop()
        watchdog = _watchdog(old_rank, self.options.timeout, what)
        try:
            for _ in range(_SURVIVE_TRIES):
                revoke(comm)
                shrunk = shrink(comm)
                try:
                    found = progress(shrunk, seq, steps)
                    self._rebuild(shrunk)
                    break
                except (MPI.Exception, _Again):  # a further failure: shrink what is left
                    if self._comm is shrunk:  # let go of what the rebuild made so far
                        dropped += self._drop()[:-1]
                    dropped.append(shrunk)
                    comm = shrunk
            else:
                raise CommError(on_rank(old_rank, f"ranks kept failing while the survivors rebuilt after {what}"))
        finally:
            t.on_peer_failure = self._survive
            if watchdog is not None:
                watchdog.cancel()
        failed = failed_ranks(before, shrunk)
        before.Free()
        for c in dropped:
            release(c)
        if not failed:  # an MPI error of another kind: the communicator was rebuilt as it was
            return CommError(on_rank(old_rank, f"MPI error in {what}: {exc.Get_error_string()}"))
        alive = self.size
        if 2 * alive < alive + len(failed) or (2 * alive == alive + len(failed) and 0 in failed):
            return self._cut_off(old_rank, failed, what, seq, handles)
        self.last_failure = Failure(failed, found, time.perf_counter() - begun)
        many = len(failed) > 1
        error = RankFailedError(
            on_rank(
                old_rank,
                f"rank{'s' if many else ''} {format_ranks(failed)} died during {what} (collective #{seq}); "
                f"the {self.size} survivors carry on over a communicator of their own, in their old order "
                f"(this rank is now rank {self.rank}; rebuilt in {self.last_failure.seconds * 1e3:.0f} ms). "
                "See docs/fault-tolerance.md for what the program does next.",
            ),
            failed,
            self.size,
        )
        error.__cause__ = exc
        for handle in handles:
            handle.abandon(error)
        if self.hold_after_failure:  # every collective until release_hold() raises the failure again
            t.broken = "ranks died, not yet recovered from"
            t.refusal = lambda: RankFailedError(
                on_rank(
                    self.rank,
                    f"rank{'s' if many else ''} {format_ranks(failed)} died (collective #{seq}), and this strategy "
                    "has not recovered yet: every survivor calls strategy.recover() before any other collective "
                    "of the strategy. See docs/fault-tolerance.md.",
                ),
                failed,
                self.size,
            )
        return error

    def release_hold(self) -> None:
        """Local: the collectives that :attr:`hold_after_failure` refused since the last failure may run again
        (the owner is about to make the survivors alike)."""
        if self.last_failure is not None and self.cut_off is None:
            self._transport.broken = self._transport.refusal = None

    def _cut_off(self, old_rank: int, failed: list[int], what: str, seq: int, handles: list[Handle]) -> CommError:
        """Local (error path): this rank's side of a failure may not carry on; every later collective raises."""
        before = self.size + len(failed)
        reason = "fewer than half" if 2 * self.size < before else "half, without rank 0"
        error = CutOffError(
            on_rank(
                old_rank,
                f"rank{'s' if len(failed) > 1 else ''} {format_ranks(failed)} of the {before} died during {what} "
                f"(collective #{seq}), or this side was cut off from them: the {self.size} "
                f"{'ranks left are' if self.size > 1 else 'rank left is'} {reason}, "
                "so they stop and the other side may carry on. A job that must survive the loss of half of its "
                "ranks keeps rank 0 on the side that lives.",
            )
        )
        for c in self._drop():
            release(c)
        self._transport.broken = "this side of a failure stopped"
        self.cut_off = error
        for handle in handles:
            handle.abandon(error)
        return error

    def _drop(self) -> list[MPI.Intracomm]:
        """Local (after ranks died): revoke every communicator this one runs on, and let go of its agreement and
        node communicator; returns the communicators to free once the survivors have their own."""
        node = self._node_communicator
        if node is not None and node is not self:
            node.abandon()
        self._node_communicator = None
        self._agreement.drop()
        split: list[MPI.Intracomm] = []
        for c in [*self._algorithms.communicators(), self._topology.node]:
            if c != MPI.COMM_NULL and all(c != d for d in split):  # the node's may be the topology's
                revoke(c)
                split.append(c)
        return [*split, self._comm]

    def _rebuild(self, comm: MPI.Intracomm) -> None:
        """Collective over ``comm`` (the survivors' new private communicator): everything this communicator
        runs on, over it; the input steps and a coordinated stop carry over."""
        stop = self._agreement.stop_requested or self._agreement.stop_agreed
        self._transport.rebind(comm)
        self._comm = comm
        self._topology = Topology(comm)
        self.local_rank = self._topology.node.rank
        track = self._track
        if track is not None and self.timeline is not None:  # the survivors' communicator: a track of its own
            track.finished = True
            track = self._track = self.timeline.track(comm.rank, comm.size)
            assert isinstance(self._transport, TimedTransport)
            self._transport.track = track
            self._record_nonblocking(track)
        self._agreement = Agreement(self._transport) if track is None else TimedAgreement(self._transport, track)
        self._agreement.stop_requested = stop
        self._build()

    def abandon(self) -> None:
        """Local, after ranks died: this communicator is unusable; revoke its MPI communicators and drop what
        waits on them, without a collective (its ranks may be dead)."""
        t = self._transport
        if t.freed or t.broken == "ranks died":
            return
        t.broken = "ranks died"
        for c in self._drop():
            release(c)  # the transport's too: mpi4py's Free() leaves it COMM_NULL, and free() does nothing

    @property
    def agreement(self) -> Agreement:
        """The agreement step of this communicator's collectives (coordinated stop flags live here)."""
        return self._agreement

    # -- life cycle ----------------------------------------------------------------
    @property
    def mpi_comm(self) -> MPI.Intracomm:
        """The private duplicate communicator (for advanced use; don't free it)."""
        return self._comm

    @property
    def num_nodes(self) -> int:
        """Number of shared-memory nodes the ranks span."""
        return self._topology.num_nodes

    def node(self) -> Communicator:
        """Collective on first call: a communicator over this node's ranks (this one, on a single node).

        Nodes are the ranks that share memory, or groups of ``options.node_size``
        consecutive ranks when that is set. Freed together with this one.
        """
        if self._node_communicator is None:
            group = self.options.node_size
            if group and group < self.size:
                split = group_split(self._comm, group)
                self._node_communicator = Communicator(split, self.options, self.backend)
                split.Free()
            else:
                self._node_communicator = (
                    self
                    if self._topology.num_nodes == 1
                    else Communicator(self._topology.node, self.options, self.backend)
                )
        return self._node_communicator

    def split(self, color: Optional[int], key: Optional[int] = None, **options: Any) -> Optional[Communicator]:
        """Collective over this communicator: a new communicator over the ranks that pass the same ``color``.

        A *process set*: the ranks of one colour (a non-negative integer),
        ordered by ``key`` (an integer; default: their rank here), with their
        own private MPI communicator and so their own agreement and collective
        numbers; collectives of different sets, and of this communicator,
        never match each other, in whatever order they interleave.
        ``color=None``: this rank joins no set and gets ``None``. A colour or
        key that is not one on one rank raises on every rank of this
        communicator.

        ``options`` override this communicator's options (which the set
        inherits); the ranks of each set agree on them when the set is
        created, as in :class:`Communicator`, so different sets may use
        different options. The set's arrays live where this rank's do (the
        same GPU), unless ``device`` is given. Free it with :meth:`free`
        (collective over the set); it does not depend on this communicator,
        which may be freed first.
        """
        error: Optional[Exception] = None
        for what, value, kind in (("color", color, "a non-negative integer"), ("key", key, "an integer")):
            integral = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            if value is not None and not (integral and (what == "key" or value >= 0)):
                error = ValueError(on_rank(self.rank, f"split: {what} must be {kind} or None, got {value!r}"))
        mpi_color = MPI.UNDEFINED if error is not None or color is None else int(color)
        mpi_key = self.rank if error is not None or key is None else int(key)

        def then(_: Optional[np.ndarray]) -> Optional[MPI.Intracomm]:
            comm = self._transport.call("split", self._comm.Split, mpi_color, mpi_key)
            return None if comm == MPI.COMM_NULL else comm

        comm = self._agreed(Call(Kind.SPLIT, "process sets"), error, then, blocking=True)
        if comm is None:
            return None
        inherited = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}
        try:
            return Communicator(
                comm, backend=None if "device" in options else self.backend, overrides={**inherited, **options}
            )
        finally:
            comm.Free()

    def free(self) -> None:
        """Collective: complete the handles still in flight (in start order), then release the duplicated
        communicators. A second call does nothing."""
        if self._transport.freed:
            return
        self._transport.complete_handles()
        if self._node_communicator not in (None, self):
            self._node_communicator.free()
        self._agreement.free()
        self._algorithms.free()
        self._topology.free()
        self._transport.free()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._transport.broken is None:
            self.free()

    def __repr__(self) -> str:
        return f"<Communicator rank {self.rank} of {self.size}, {self.backend!r}>"

    # -- collectives -------------------------------------------------------------
    def allreduce(
        self,
        array: Array,
        op: Union[ReduceOp, str] = ReduceOp.SUM,
        *,
        out: Optional[Array] = None,
        inplace: bool = False,
        name: str = "array",
        compression: Optional[str] = None,
    ) -> Any:
        """Collective: reduce ``array`` elementwise across all ranks.

        Returns the reduced array (``array`` itself when ``inplace``, else a new
        array, or ``out`` when given: of the input's shape and dtype, and a
        device array when the input is one). ``MEAN`` divides the sum by the
        number of ranks and is only defined for floating and complex dtypes. With
        ``options.check_finite``, a NaN or Inf on any rank raises
        :class:`~mpidist.NonFiniteError` on every rank instead of spreading. Buffers
        larger than ``options.piece_bytes`` are reduced in pieces of that
        size, in place, without a full-size temporary; with
        ``options.hierarchical``, each piece by the two-level algorithm.

        ``compression`` (``"fp16"``, ``"bf16"``; ``"none"``: exact; ``None``:
        ``options.compression``) sends a float32 ``SUM`` or ``MEAN`` over the
        wire in 16 bits (:mod:`~mpidist._comm.compression`); asked for here, on
        another dtype or op it raises ``ValueError``. Every rank passes the same.
        """
        return self._allreduce(array, op, out, inplace, name, blocking=True, compression=compression)

    def iallreduce(
        self,
        array: Array,
        op: Union[ReduceOp, str] = ReduceOp.SUM,
        *,
        out: Optional[Array] = None,
        inplace: bool = False,
        name: str = "array",
    ) -> Handle:
        """Collective, nonblocking :meth:`allreduce`: returns a :class:`Handle`.

        Don't touch ``array`` (or ``out``) until ``handle.wait()`` returned.
        The pieces advance while this rank is inside MPI (``handle.test()``,
        ``wait()``, other MPI calls); whether they also advance during pure
        computation depends on the MPI library's progress engine.
        """
        return self._allreduce(array, op, out, inplace, name, blocking=False)

    def broadcast(self, array: Array, root: int = 0, *, name: str = "array") -> Any:
        """Collective: overwrite ``array`` on every rank with root's; returns ``array``.

        Every rank passes an array of the same shape and dtype.
        """
        return self._broadcast(array, root, name, blocking=True)

    def ibroadcast(self, array: Array, root: int = 0, *, name: str = "array") -> Handle:
        """Collective, nonblocking :meth:`broadcast`: returns a :class:`Handle`."""
        return self._broadcast(array, root, name, blocking=False)

    def allgather(self, array: Array, *, name: str = "array", out: Optional[Array] = None) -> Any:
        """Collective: concatenate every rank's ``array`` along axis 0, in rank order.

        Lengths along axis 0 may differ between ranks; the other dimensions and
        the dtype must agree. A 0-d array counts as one element. Returns a new
        array on every rank, or ``out`` (C-contiguous, exactly the result's
        shape and dtype) filled with it.
        """
        return self._allgather(array, name, blocking=True, out=out)

    def iallgather(self, array: Array, *, name: str = "array") -> Handle:
        """Collective, nonblocking :meth:`allgather`: returns a :class:`Handle`."""
        return self._allgather(array, name, blocking=False)

    def reduce_scatter(
        self,
        array: Array,
        op: Union[ReduceOp, str] = ReduceOp.SUM,
        counts: Optional[Sequence[int]] = None,
        *,
        name: str = "array",
    ) -> Any:
        """Collective: reduce ``array`` across ranks, then give each rank its block of axis 0.

        ``counts[r]`` rows go to rank ``r``; by default rows are split as evenly
        as possible (the first ``len % size`` ranks get one more). Every rank
        passes the same shape, of at least one dimension (a 0-d array is a
        ``ValueError``, on every rank). Returns this rank's block as a new array.
        """
        return self._reduce_scatter(array, op, counts, name, blocking=True)

    def ireduce_scatter(
        self,
        array: Array,
        op: Union[ReduceOp, str] = ReduceOp.SUM,
        counts: Optional[Sequence[int]] = None,
        *,
        name: str = "array",
    ) -> Handle:
        """Collective, nonblocking :meth:`reduce_scatter`: returns a :class:`Handle`.

        Don't touch ``array`` until ``handle.wait()`` returned. With
        ``options.check_overflow``, an integer ``SUM`` is reduced whole (as a
        nonblocking allreduce of its 64-bit form), and ``wait()`` raises
        :class:`~mpidist.IntegerOverflowError` on every rank when a sum does
        not fit.
        """
        return self._reduce_scatter(array, op, counts, name, blocking=False)

    def alltoall(self, array: Array, splits: Optional[Any] = None, *, name: str = "array") -> tuple[Any, np.ndarray]:
        """Collective: ``splits[r]`` rows of ``array`` to rank ``r``; returns ``(received, received_splits)``.

        Axis 0 of ``array`` is cut in order: the first ``splits[0]`` rows go
        to rank 0, the next ``splits[1]`` to rank 1, and so on. ``splits`` is
        one non-negative integer per rank adding up to ``array.shape[0]`` (a
        list, or a 1-d integer array of any library); each rank passes its
        own. ``None`` splits the rows evenly: then every rank passes
        ``splits=None`` and the same shape, whose length is a multiple of the
        number of ranks.

        ``received`` holds the rows every rank sent to this one, in rank
        order, as a new array of ``array``'s module (a device array for a
        device input); ``received_splits`` (a NumPy ``int64`` array of one
        count per rank) says how many rows came from each, as in Horovod.
        The dtype and the dimensions after axis 0 must agree; lengths along
        axis 0 may differ. Bad splits on one rank (not one integer per rank,
        negative, not adding up to the rows) raise ``ValueError`` there and
        :class:`~mpidist.CollectiveMismatchError` on the others, before any
        data moves; so does a 0-d array, which has no axis 0.

        The data moves in one ``MPI_Alltoall`` for even splits, or inside the
        agreement's record when the rows are that small
        (:class:`~mpidist._comm.exchange.AlltoallPlan`); otherwise the counts
        travel first (in the record, or one ``MPI_Alltoall`` of one integer
        per rank), then the rows (one ``MPI_Alltoallv``).
        """
        return self._alltoall(array, splits, name, blocking=True)

    def ialltoall(self, array: Array, splits: Optional[Any] = None, *, name: str = "array") -> Handle:
        """Collective, nonblocking :meth:`alltoall`: returns a :class:`Handle` whose ``wait()`` gives
        ``(received, received_splits)``.

        Don't touch ``array`` until ``handle.wait()`` returned. With splits of
        each rank's own, the counts are exchanged (a blocking exchange of one
        integer per rank) as the data stage starts: when the ranks' agreement
        on the call completes, in ``handle.test()``, ``handle.wait()`` or this
        rank's next collective, or at once with ``check_collectives`` off.
        The rows then move in the background; completing the handle makes no
        further collective call.
        """
        return self._alltoall(array, splits, name, blocking=False)

    def gather(self, array: Array, root: int = 0, *, name: str = "array") -> Optional[Any]:
        """Collective: every rank's ``array`` concatenated along axis 0 on rank ``root``; ``None`` on the others.

        :meth:`allgather` to one rank: the rows arrive in rank order, as a
        new array of the root's array module, and the other ranks send their
        own data and receive nothing. Lengths along axis 0 may differ between
        ranks; the dtype, the dimensions after axis 0 and ``root`` must agree.
        A 0-d array counts as one element.
        """
        return self._gather(array, root, name)

    def scatter(self, arrays: Optional[Sequence[Array]], root: int = 0, *, name: str = "array") -> Any:
        """Collective: rank ``root``'s ``arrays[r]`` to rank ``r``; returns this rank's array.

        On the root, ``arrays`` is one array per rank, all of one dtype and
        array module; their shapes may differ. The other ranks' ``arrays`` is
        ignored (pass ``None``). Every rank gets a new array of the shape and
        dtype the root gave it, in the communicator's array module (CuPy on a
        GPU communicator, else NumPy); only the root sends more than its own
        data. ``root`` must agree. ``arrays`` that are not one array per rank
        of one dtype raise on the root, and
        :class:`~mpidist.CollectiveMismatchError` on the others.
        """
        return self._scatter(arrays, root, name)

    def barrier(self) -> None:
        """Collective: return once every rank has entered (honours the timeout)."""
        if self._agreement.enabled:
            self._agreement.agree(Call(Kind.BARRIER, "barrier"))  # the exchange itself synchronises
            return
        self._transport.begin()
        self._transport.run("barrier", "Barrier")

    def count_input_step(self) -> None:
        """Local: note that this rank drew one step from an mpidist input iterator over this communicator.

        The number of steps drawn is part of what the ranks agree on at each
        later collective (with ``check_collectives``): a rank that skipped or
        repeated a step raises :class:`~mpidist.CollectiveMismatchError` on
        every rank in the step's first collective.
        """
        self._agreement.count_input_step()

    def left_step(self, where: str, steps_left: int, exc: BaseException) -> None:
        """Local: note that this rank left ``where`` (``"strategy.run"``, ``"merge_call"``: a step of the program,
        in which the others may make collectives) by ``exc``, unless it was noted already (:attr:`steps_left` is
        no longer ``steps_left``, the count before the step).

        How many steps a rank left so is part of what the ranks agree on at each
        later collective (with ``check_collectives``): where only some ranks left a
        step, they skipped collectives the others are in, and their next collective
        raises :class:`~mpidist.CollectiveMismatchError` on every rank, naming them,
        instead of pairing with an unrelated collective of the others. mpidist's
        :class:`~mpidist.CommError` (ranks died, a deadline passed: raised on every
        rank, though not always in the same collective) is not counted.
        """
        if self._agreement.steps_left == steps_left and not isinstance(exc, CommError):
            self._agreement.count_step_left(f"{type(exc).__name__} in {where}")

    @property
    def steps_left(self) -> int:
        """Steps of the program this rank left by an exception (:meth:`left_step`)."""
        return self._agreement.steps_left

    def split_counts(self, n: int) -> list[int]:
        """Local: ``n`` items split as evenly as possible over the ranks, lower ranks first."""
        base, extra = divmod(n, self.size)
        return [base + (1 if r < extra else 0) for r in range(self.size)]

    def fail(self, error: Exception, name: str) -> NoReturn:
        """Collective: take part in the collective the other ranks make, with this rank's ``error``.

        For a caller that found a problem with its own arguments before it
        could call a collective: this rank raises ``error``, and the other
        ranks (in whatever collective they entered) raise
        :class:`~mpidist.CollectiveMismatchError` naming this rank and the error.
        """
        if self._agreement.enabled:
            self._agreement.agree(Call(Kind.FUSED, repr(name)), error)
        raise error

    def outcome(self, error: Optional[BaseException], name: str) -> Failures:
        """Collective: did every rank succeed? ``{}`` when every rank passed ``error=None``; otherwise
        ``{rank: what failed there}`` for every failed rank, the same dict keys on every rank
        (this rank's own entry is its exception object; other ranks' entries are their messages as
        ``"ExceptionType: message"`` strings). Cheap in the common case (one small reduction,
        nothing at one rank); per-rank detail only when some rank failed. Honours the deadline.

        ``name`` says what the ranks were doing (for messages); :func:`describe_failures`
        writes the result as one line.
        """
        if self.size == 1:
            return {} if error is None else {self.rank: error}
        failed = np.array([0.0 if error is None else 1.0])
        if not self.allreduce(failed, ReduceOp.SUM, inplace=True, name=f"{name} (outcome)")[0]:
            return {}
        return gather_failures(self._transport, error, f"{name} (failures)")

    # -- many arrays at once ------------------------------------------------------------
    def reduce_apply(
        self,
        sends: Sequence[Array],
        targets: Sequence[Array],
        ops: Sequence[Optional[ReduceOp]],
        fn: UpdateFn,
        names: Sequence[str],
        in_place: bool = False,
        error: Optional[Exception] = None,
        compression: Optional[str] = None,
    ) -> None:
        """Collective: ``fn(targets[i], reduced sends[i])`` for every ``i``, fused.

        ``ops[i]`` ``None`` means rank 0's value. ``fn`` updates its first
        argument in place, elementwise: it is called on flat slices, possibly
        spanning several targets that lie back to back, with the reduced
        values in a scratch buffer it must not keep. ``MEAN`` divides before
        ``fn`` sees the values. With ``in_place`` the sends are overwritten
        with their reduced values (no scratch copy); otherwise they are left
        as they are. Every rank passes arrays of the same dtypes and shapes in
        the same order; the ranks agree on the whole list with one record.
        ``error`` is this rank's own problem with its arguments, found by the
        caller: raised here once every rank has seen it (the others raise a
        mismatch naming this rank). ``compression`` as in :meth:`allreduce`.
        """
        self._fusion.reduce_apply(sends, targets, ops, fn, names, in_place, error, compression)

    def prepare_update(
        self, like: Array, op: Optional[ReduceOp], fn: UpdateFn, name: str
    ) -> Optional[Callable[[Array, Array], None]]:
        """Local: a function ``update(send, target)`` that makes ``reduce_apply((send,), (target,), (op,), fn,
        (name,))`` on a shorter path, or ``None`` where such calls have none.

        For the calls one variable's updates make over and over, with sends
        and targets of ``like``'s type, dtype and shape, C-contiguous: small
        host ``SUM``/``MEAN`` reductions that travel inside the agreement
        record. The ranks agree on the same call either way. Valid while
        :attr:`generation` stays what it was when it was made (the
        communicator is rebuilt after ranks died). Nothing checks the
        promise: the strategy's variable updates use it, after fitting the
        value to the variable.

        :meta private:
        """
        return self._fusion.prepare(like, op, fn, name)

    def allreduce_many(
        self,
        arrays: Sequence[Array],
        op: Union[ReduceOp, str] = ReduceOp.SUM,
        names: Optional[Sequence[str]] = None,
        *,
        out: Optional[Sequence[Array]] = None,
        compression: Optional[str] = None,
    ) -> list[Any]:
        """Collective: every array reduced by ``op``, as new arrays (or into ``out``); the inputs are left as they are.

        Small arrays share MPI calls through a reusable bucket; one agreement
        record covers the whole list. ``out`` (one array per input, of its
        shape and dtype) is the form that allocates nothing in steady state:
        arrays larger than ``options.fusion_bytes`` are reduced straight into
        their ``out`` array; ``out=arrays`` reduces the inputs in place.
        ``compression`` as in :meth:`allreduce`, for every array of the list.
        """
        names = _names(names, len(arrays))
        arrays = self._as_arrays(arrays, names, "allreduce_many")
        if out is not None:
            out = self._as_arrays(out, [f"out[{i}]" for i in range(len(out))], "allreduce_many")
        return self._fusion.allreduce_many(arrays, ReduceOp.of(op), names, out, compression)

    def iallreduce_many(
        self,
        arrays: Sequence[Array],
        op: Union[ReduceOp, str] = ReduceOp.SUM,
        names: Optional[Sequence[str]] = None,
        then: Callable[[list[Any]], Any] = list,
    ) -> Handle:
        """Collective, nonblocking :meth:`allreduce_many`: ``wait()`` returns ``then(list of results)``.

        The inputs are copied when the call starts, so they may change afterwards.
        """
        names = _names(names, len(arrays))
        arrays = self._as_arrays(arrays, names, "iallreduce_many")
        return self._fusion.iallreduce_many(arrays, ReduceOp.of(op), names, then)

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
    def _op(self, op: Union[ReduceOp, str]) -> tuple[Optional[ReduceOp], Optional[Exception]]:
        try:
            return ReduceOp.of(op), None
        except ValueError as exc:
            return None, ValueError(on_rank(self.rank, str(exc)))

    def _converted(
        self, array: Any, out: Any, name: str, error: Optional[Exception]
    ) -> tuple[Any, Any, Optional[Exception]]:
        """Local: ``array`` and ``out`` (``None``: none) as NumPy or CuPy arrays where they are other libraries'
        arrays (:func:`~mpidist._comm.backend.as_array`: views of the same memory, so what a collective writes
        into them reaches the caller's objects); and ``error``, or the conversion's error when it is the first,
        which the agreement then raises as any bad argument."""
        try:
            array = as_array(array, repr(name), self.rank)
            if out is not None:
                out = as_array(out, f"out= of {name!r}", self.rank)
        except Exception as exc:  # whatever the other library raises: this rank's error, agreed
            error = error or exc
        return array, out, error

    def _as_arrays(self, arrays: Sequence[Any], names: Sequence[str], what: str) -> Sequence[Any]:
        """Local (collective only when one cannot be converted): ``arrays`` as NumPy or CuPy arrays, as
        :meth:`_converted` converts them; a conversion that fails is raised on this rank in the collective
        the others entered (:meth:`fail`)."""
        for a in arrays:
            if a.__class__ is not np.ndarray:
                break
        else:
            return arrays
        try:
            return [as_array(a, repr(n), self.rank) for a, n in zip(arrays, names)]
        except Exception as exc:  # whatever the other library raises: this rank's error, agreed
            self.fail(exc, what)

    def _allreduce(
        self,
        array: Array,
        op: Any,
        out: Optional[Array],
        inplace: bool,
        name: str,
        blocking: bool,
        compression: Optional[str] = None,
    ) -> Any:
        # op: a ReduceOp or its name (Any: the per-collective path converts it in place, telling the
        # two apart by op.__class__, which the type checker does not narrow on)
        error = None
        if op.__class__ is not ReduceOp:
            op, error = self._op(op)
        if array.__class__ is not np.ndarray or out is not None:
            array, out, error = self._converted(array, out, name, error)
        error = error or validate(array, op, name, self.rank, writable=inplace)
        if error is None and out is not None:
            error = (
                ValueError(on_rank(self.rank, f"allreduce of {name!r}: pass either inplace=True or out=, not both"))
                if inplace
                else validate_out(array, out, f"allreduce of {name!r}: out=", "the input", self.rank)
            )
        wire = self.options.compression
        if compression is not None:  # asked for on this call: checked here, and agreed as part of the call
            wire, wrong = wire_of(compression, wire, self.rank)
            error = error or wrong or wire_error(wire, [array], [op], [name], self.rank, f"allreduce of {name!r}")
        if wire is not None and (error is not None or not blocking or not compressed(wire, op, array.dtype)):
            wire = None  # the option leaves other dtypes and ops, and nonblocking reductions, exact
        if error is None:
            target = array if inplace else out if out is not None else array_module(array).empty_like(array)
        agreement = self._agreement
        if not agreement.enabled:
            self._transport.begin()
            if error is not None:
                raise error
            if blocking and wire is None and self._one_call(target) and not self._checked(op, array):
                # the common small host case: one piece, nothing to synchronise or stage (the per-update latency path)
                if target is not array:
                    target[...] = array  # reduced in place: the output form never changes the MPI calls
                self._choose(target.nbytes).reduce("allreduce", target, self._transport.mpi_op(op, array.dtype))
                if op is ReduceOp.MEAN:
                    divide_in_place(target, self.size)
                return target
            result = self._reduce_data(array, target, op, name, blocking, wire=wire)
            return result if blocking else Handle(self._transport, None, result, keep=(array, out))
        if blocking:
            if error is None:
                carried = agreement.agree_array(Kind.ALLREDUCE, name, op, array, self.options.check_finite, wire=wire)
            else:
                carried = agreement.agree(Call(Kind.ALLREDUCE, name), error)
            if carried is None:
                return self._reduce_data(array, target, op, name, blocking, wire=wire)
            if op is ReduceOp.SUM and target.dtype.char == "d":  # _store's common case, one call less
                target[...] = carried
            else:
                self._store(carried, target, op, name)
            return target

        def then(carried: Optional[np.ndarray]) -> Any:
            if carried is None:
                return self._reduce_data(array, target, op, name, blocking)
            self._store(carried.reshape(target.shape), target, op, name)
            return [], lambda: target

        call = (
            Call(Kind.ALLREDUCE, name, op, array.dtype.char, tuple(array.shape))
            if error is None
            else Call(Kind.ALLREDUCE, name)
        )
        return Handle(
            self._transport, agreement.start(call, error, array, self.options.check_finite, then), keep=(array, out)
        )

    def _store(self, carried: np.ndarray, target: Array, op: ReduceOp, name: str) -> None:
        """Local: the sums carried by the agreement record (shaped like ``target``) into ``target``."""
        char = target.dtype.char
        if char == "d" and op is ReduceOp.SUM:  # the common case first (floats are never overflow-checked)
            target[...] = carried
        elif self._checked(op, target):
            target[...] = overflow.narrow(carried, target.dtype, name, self.rank).reshape(target.shape)
        elif char in "bhiBHI":
            target[...] = carried.astype(np.int64)  # float64 sums of integers are exact; wrap like MPI
        elif char == "?":
            target[...] = carried != 0
        elif op is ReduceOp.MEAN:
            # target is a host ndarray (only host data is carried); NumPy's stubs take no Array as out=
            np.divide(carried, self.size, out=target, casting="unsafe")  # type: ignore[call-overload]
        else:
            target[...] = carried

    def _reduce_data(
        self,
        array: Array,
        target: Array,
        op: ReduceOp,
        name: str,
        blocking: bool,
        *,
        check: bool = True,
        wire: Optional[str] = None,
    ) -> Any:
        """Collective, once agreed: ``target`` <- the reduction of every rank's ``array``, in pieces.

        Integer sums are checked with ``options.check_overflow`` (unless ``check`` is false); ``wire``: a
        blocking float32 SUM or MEAN compressed so (:mod:`~mpidist._comm.compression`).
        """
        if check and self._checked(op, array):  # reduce the 64-bit form, then write only sums that fit
            target[...] = self._checked_sum(array, name).reshape(target.shape)
            return target if blocking else ([], lambda: target)
        if target is not array:  # reduced in place: the output form never changes the MPI calls
            target[...] = array  # before to_mpi, which synchronises a device array's stream
        what = f"allreduce of {name!r}"
        if wire is not None:
            self._compression.reduce(what, target.reshape(-1), op, wire)
            return target
        if array.dtype.char in HALF_FLOATS:  # 16-bit floats: in float32 pieces, rounded once
            if blocking:
                self._widening.reduce(what, target.reshape(-1), op)
                return target
            requests, complete = self._widening.start(what, target.reshape(-1), op)
            return requests, lambda: (complete(), target)[1]
        recv = self.backend.to_mpi(target, self.cuda_aware, reuse=blocking)
        mpi_op = self._transport.mpi_op(op, array.dtype)
        flat_recv, flat_target = recv.reshape(-1), target.reshape(-1)
        reduction = self._choose(target.nbytes)
        ranges = reduction.pieces(target)
        pieces = [flat_recv[lo:hi] for lo, hi in ranges]
        staged = recv is not target

        def finish() -> Any:
            self.backend.from_mpi(target, recv)
            if op is ReduceOp.MEAN and (staged or not blocking):
                divide_in_place(target, self.size)
            return target

        if not blocking:
            requests, complete = reduction.start(what, pieces, mpi_op)
            return requests, lambda: (complete(), finish())[1]

        def divide(k: int) -> None:  # while the piece is in cache
            lo, hi = ranges[k]
            divide_in_place(flat_target[lo:hi], self.size)

        reduction.reduce_pieces(what, pieces, mpi_op, divide if op is ReduceOp.MEAN and not staged else None)
        return finish()

    def _reduce_data_whole(
        self,
        array: Array,
        target: Array,
        op: ReduceOp,
        name: str,
        blocking: bool,
        *,
        check: bool = True,
        wire: Optional[str] = None,
    ) -> Any:
        """Collective, with fault tolerance: :meth:`_reduce_data`, blocking ones into a copy written to ``target``
        once every piece arrived.

        Ranks may die between two pieces (or inside one MPI call, which may
        have written part of its buffer); ``target`` then keeps what it held.
        One more pass over the data (two for an in-place reduction).
        """
        if not blocking:
            return Communicator._reduce_data(self, array, target, op, name, blocking, check=check, wire=wire)
        scratch = self._fusion.scratch(target, target.size)[: target.size].reshape(target.shape)
        Communicator._reduce_data(self, array, scratch, op, name, blocking, check=check, wire=wire)
        target[...] = scratch
        return target

    def _checked(self, op: Optional[ReduceOp], array: Array) -> bool:
        return self.options.check_overflow and overflow.applies(op, array.dtype)

    def _checked_sum(self, array: Array, name: str, blocking: bool = True) -> Any:
        """Collective, once agreed: the exact SUM of every rank's integer ``array``, flat, as a new array.

        Raises :class:`~mpidist.IntegerOverflowError` on every rank when a sum
        does not fit the dtype (see :mod:`~mpidist._comm.overflow`). Nonblocking:
        the data stage (requests, and the step that returns the sum or raises).
        """
        wide = overflow.widen(array)
        if not blocking:
            requests, reduced = self._reduce_data(wide, wide, ReduceOp.SUM, name, blocking=False, check=False)
            return requests, lambda: overflow.narrow(reduced(), array.dtype, name, self.rank)
        self._reduce_data(wide, wide, ReduceOp.SUM, name, blocking=True, check=False)
        return overflow.narrow(wide, array.dtype, name, self.rank)

    def _one_call(self, target: Array) -> bool:
        """Local: whether MPI may reduce into ``target`` with one call, as it is: small, on the host, and not
        of a 16-bit float dtype (reduced through float32: :mod:`~mpidist._comm.half`).

        Device arrays always go through :meth:`Backend.to_mpi`, which synchronises their stream
        (a host ``target`` has a host input: :func:`~mpidist._comm.agreement.validate_out`).
        """
        return (
            target.nbytes <= self.options.piece_bytes
            and not is_device_array(target)
            and target.dtype.char not in HALF_FLOATS
        )

    def _broadcast(self, array: Array, root: Any, name: str, blocking: bool) -> Any:
        # root: Any, what the user passed (checked here)
        root, error = self._checked_root(root, f"broadcast of {name!r}")
        if array.__class__ is not np.ndarray:
            array, _, error = self._converted(array, None, name, error)
        error = error or validate(array, None, name, self.rank, writable=True)
        call = Call(Kind.BROADCAST, name, None, *_layout(array, error), root=int(root))
        what = f"broadcast of {name!r}"

        def then(_: Optional[np.ndarray]) -> Any:
            buf = self.backend.to_mpi(array, self.cuda_aware, reuse=blocking)

            def finish() -> Any:
                self.backend.from_mpi(array, buf)
                return array

            args = (buf.reshape(-1), root)
            if not blocking:
                return ([self._transport.start("Bcast", *args)] if array.size else []), finish
            if array.size:
                self._transport.run(what, "Bcast", *args)
            return finish()

        return self._agreed(call, error, then, blocking, keep=(array,))

    def _allgather(self, array: Array, name: str, blocking: bool, out: Optional[Array] = None) -> Any:
        array, out, error = self._converted(array, out, name, None)
        error = error or validate(array, None, name, self.rank)
        if error is None and out is not None:
            error = _gather_out_error(array, out, name, self.rank)
        call = Call(Kind.ALLGATHER, name, None, *_layout(array, error))
        what = f"allgather of {name!r}"

        def then(_: Optional[np.ndarray]) -> Any:
            shape = tuple(array.shape) if array.ndim else (1,)
            # each rank's length, and the length of its out= (-1: none): out= given on some ranks
            # only changes no MPI call, and one that does not fit is known to every rank at once
            mine = np.array([shape[0], -1 if out is None else out.shape[0]], dtype=np.int64)
            rows = np.empty((self.size, 2), dtype=np.int64)
            self._transport.run(f"{what} (lengths)", "Allgather", mine, rows)
            lengths, total = rows[:, 0], int(rows[:, 0].sum())
            wrong = [r for r, given in enumerate(rows[:, 1].tolist()) if given not in (-1, total)]
            if wrong:
                self._refuse_gather_out(wrong, (total,) + shape[1:], out, name)
            counts = lengths * int(np.prod(shape[1:], dtype=np.int64))
            result = out if out is not None else array_module(array).empty((total,) + shape[1:], dtype=array.dtype)
            send = self.backend.to_mpi(array, self.cuda_aware, reuse=False)
            recv = self.backend.to_mpi(result, self.cuda_aware, reuse=False)

            # held by the finishing step until the transfer completed (mpi4py's nonblocking Allgatherv keeps no
            # reference to its buffers, and MPI reads the staged copy of a device input until then)
            buffers = (send, recv)

            def finish() -> Any:
                self.backend.from_mpi(result, buffers[1])
                return result

            dtype = mpi_datatype(send)
            counted = counts.tolist()
            args = ([send.reshape(-1), dtype], [recv.reshape(-1), (counted, offsets(counted)), dtype])
            if not blocking:
                return [self._transport.start("Allgatherv", *args)], finish
            self._transport.run(what, "Allgatherv", *args)
            return finish()

        return self._agreed(call, error, then, blocking, keep=(array, out))

    def _reduce_scatter(
        self, array: Array, requested: Union[ReduceOp, str], counts: Optional[Sequence[int]], name: str, blocking: bool
    ) -> Any:
        op, error = self._op(requested)
        array, _, error = self._converted(array, None, name, error)
        error = error or validate(array, op, name, self.rank) or self._no_axis_0(array, f"reduce_scatter of {name!r}")
        rows = array.shape[0] if error is None else 0
        split: list[int] = []
        if error is None:
            given: Optional[list[int]]
            try:
                given = self.split_counts(rows) if counts is None else [int(c) for c in counts]
            except (TypeError, ValueError):
                given = None
            if given is None or len(given) != self.size or sum(given) != rows or min(given) < 0:
                error = ValueError(
                    on_rank(
                        self.rank,
                        f"reduce_scatter of {name!r}: counts {given} must be "
                        f"{self.size} non-negative numbers adding up to {rows} rows",
                    )
                )
            else:
                split = given
        call = Call(
            Kind.REDUCE_SCATTER, name, op, *_layout(array, error), extra=tuple(split) if error is None else None
        )

        def then(_: Optional[np.ndarray]) -> Any:
            assert op is not None  # then runs only once every rank's arguments were valid
            row = int(np.prod(array.shape[1:], dtype=np.int64))
            shape = (split[self.rank],) + tuple(array.shape[1:])
            if self._checked(op, array):  # the whole exact sum, then this rank's block of it
                start = sum(split[: self.rank]) * row

                def block(summed: Array) -> Any:
                    return summed[start : start + split[self.rank] * row].reshape(shape)

                if not blocking:
                    requests, summed = self._checked_sum(array, name, blocking=False)
                    return requests, lambda: block(summed())
                return block(self._checked_sum(array, name))
            # 16-bit floats: a float32 copy of the input is reduced, and the block rounded once (mpidist._comm.half)
            source = array.astype(np.float32) if array.dtype.char in HALF_FLOATS else array
            result = array_module(array).empty(shape, dtype=source.dtype)
            send = self.backend.to_mpi(source, self.cuda_aware, reuse=blocking)
            recv = self.backend.to_mpi(result, self.cuda_aware, reuse=False)
            args = (send, recv, [c * row for c in split], self._transport.mpi_op(op, source.dtype))

            def finish() -> Any:
                # holds the buffers (args) until the transfer completed: mpi4py's Ireduce_scatter keeps no reference
                self.backend.from_mpi(result, args[1])
                if op is ReduceOp.MEAN:
                    divide_in_place(result, self.size)
                return result if source is array else result.astype(array.dtype)

            if not blocking:
                return [self._transport.start("Reduce_scatter", *args)], finish
            self._transport.run(f"reduce_scatter of {name!r}", "Reduce_scatter", *args)
            return finish()

        return self._agreed(call, error, then, blocking, keep=(array,))

    def _alltoall(self, array: Array, splits: Any, name: str, blocking: bool) -> Any:
        error = None
        if array.__class__ is not np.ndarray:
            array, _, error = self._converted(array, None, name, None)
        error = error or validate(array, None, name, self.rank) or self._no_axis_0(array, f"alltoall of {name!r}")
        counts: list[int] = []
        if error is None:
            try:
                counts = send_counts(splits, array.shape[0], self.size)
            except ValueError as exc:
                error = ValueError(on_rank(self.rank, f"alltoall of {name!r}: {exc}"))
            except Exception as exc:  # whatever another library raises reading splits: this rank's error, agreed
                error = exc
        if error is not None:
            return self._agreed(Call(Kind.ALLTOALL, name, None, *_layout(array, error)), error, _nothing, blocking)
        plan = self._exchange.plan(name, array, counts[0] if splits is None else None)
        agreement = self._agreement
        if not agreement.enabled:
            self._transport.begin()
            result = self._exchange.alltoall(plan, array, counts, blocking, None)
            return result if blocking else Handle(self._transport, None, result, keep=(array,))
        image = plan.image(array, counts)
        if blocking:
            if plan.agreed is None:
                plan.agreed = agreement.plan((plan, "agreed"), plan.call, plan.carry, (plan.carry,))
            return self._exchange.alltoall(plan, array, counts, True, agreement.agree_planned(plan.agreed, image))

        def then(carried: Optional[np.ndarray]) -> Any:
            return self._exchange.alltoall(plan, array, counts, False, carried)

        return Handle(
            self._transport, agreement.start(plan.call, None, image, then=then, carry=plan.carry), keep=(array,)
        )

    def _gather(self, array: Array, root: Any, name: str) -> Optional[Any]:
        # root: Any, what the user passed (checked here)
        root, error = self._checked_root(root, f"gather of {name!r}")
        array, _, error = self._converted(array, None, name, error)
        error = error or validate(array, None, name, self.rank)
        call = Call(Kind.GATHER, name, None, *_layout(array, error), root=root)
        return self._agreed(
            call, error, lambda _: self._exchange.gather(array, root, f"gather of {name!r}"), blocking=True
        )

    def _scatter(self, arrays: Any, root: Any, name: str) -> Any:
        # arrays, root: Any, what the user passed (checked here; arrays only on the root)
        root, error = self._checked_root(root, f"scatter of {name!r}")
        mine: Optional[list[Any]] = None
        if error is None and self.rank == root:
            mine, error = self._scatter_arrays(arrays, name)
        call = Call(Kind.SCATTER, name, root=root)
        return self._agreed(call, error, lambda _: self._exchange.scatter(mine, root, f"scatter of {name!r}"), True)

    def _scatter_arrays(self, arrays: Any, name: str) -> tuple[Optional[list[Any]], Optional[Exception]]:
        """Local, on a scatter's root: its ``arrays`` as NumPy or CuPy arrays, or the error saying why they are not
        one array per rank of one dtype and array module."""
        what = f"scatter of {name!r}"
        try:
            given = list(arrays)
        except TypeError:
            given = None
        if given is None or len(given) != self.size:
            got = f"{len(given)} items" if given is not None else f"a {type(arrays).__name__}"
            return None, ValueError(
                on_rank(self.rank, f"{what}: the root passes a list of {self.size} arrays, one per rank; got {got}")
            )
        converted = []
        for r, item in enumerate(given):
            array, _, error = self._converted(item, None, f"{name}[{r}]", None)
            error = error or validate(array, None, f"{name}[{r}]", self.rank)
            if error is not None:
                return None, error
            converted.append(array)
        first = converted[0]
        for r, array in enumerate(converted):
            if array.dtype != first.dtype or array.__class__ is not first.__class__:
                return None, ValueError(
                    on_rank(
                        self.rank,
                        f"{what}: every array must be of one dtype and array module; {name}[0] is a "
                        f"{type(first).__module__} {first.dtype} array, {name}[{r}] a "
                        f"{type(array).__module__} {array.dtype} one",
                    )
                )
        return converted, None

    def _checked_root(self, root: Any, what: str) -> tuple[int, Optional[Exception]]:
        """Local: ``root`` (what the user passed) as a rank of this communicator; else 0, and the error saying why."""
        if isinstance(root, (int, np.integer)) and not isinstance(root, bool) and 0 <= root < self.size:
            return int(root), None
        return 0, ValueError(
            on_rank(self.rank, f"{what}: root {root!r} is not a rank of a {self.size}-rank communicator")
        )

    def _no_axis_0(self, array: Array, what: str) -> Optional[Exception]:
        """Local: the error for a 0-d ``array`` passed to a collective that splits axis 0 (``None`` otherwise)."""
        if array.ndim:
            return None
        return ValueError(
            on_rank(
                self.rank,
                f"{what}: a 0-d array (shape ()) has no axis 0 to split over the ranks; "
                "pass an array of at least one dimension (for example array.reshape(1))",
            )
        )

    def _agreed(
        self,
        call: Call,
        error: Optional[Exception],
        then: Callable[[Optional[np.ndarray]], Any],
        blocking: bool,
        keep: tuple = (),
    ) -> Any:
        """Collective: run ``then`` once the ranks agreed on ``call`` (directly when agreement is off)."""
        agreement = self._agreement
        if not agreement.enabled:
            self._transport.begin()
            if error is not None:
                raise error
            result = then(None)
            return result if blocking else Handle(self._transport, None, result, keep)
        if blocking:
            return then(agreement.agree(call, error))
        return Handle(self._transport, agreement.start(call, error, then=then), keep=keep)

    def _refuse_gather_out(self, wrong: list[int], shape: tuple, out: Any, name: str) -> NoReturn:
        """Local, on every rank alike: the error for ``out=`` arrays of ranks ``wrong`` that do not fit ``shape``."""
        if self.rank in wrong:
            raise ValueError(
                on_rank(
                    self.rank,
                    f"allgather of {name!r}: out= must have the result's shape {shape}, got {tuple(out.shape)}",
                )
            )
        raise CollectiveMismatchError(
            on_rank(
                self.rank,
                f"allgather of {name!r}: rank{'s' if len(wrong) > 1 else ''} {format_ranks(wrong)} passed an out= "
                f"that does not fit the result {shape}; nothing was gathered",
            )
        )


class Failure:
    """What the last failure of ranks was, as every survivor saw it. Local object.

    ``failed_ranks`` in the numbering before the failure; ``progress`` how far
    each survivor got (:class:`~mpidist._comm.survival.Progress`, by new rank);
    ``seconds`` from this rank's first sight of the failure to a working
    communicator of the survivors.
    """

    def __init__(self, failed_ranks: list[int], progress: Progress, seconds: float) -> None:
        self.failed_ranks = failed_ranks
        self.progress = progress
        self.seconds = seconds


class _Again(CommError):
    """A further failure while the survivors rebuild (internal: the rebuild starts again)."""


def _again(what: str, exc: MPI.Exception) -> CommError:
    return _Again(f"ranks died during {what}: {exc.Get_error_string()}")


def _gather_out_error(array: Any, out: Any, name: str, rank: int) -> Optional[Exception]:
    """Local: why ``out`` cannot receive an allgather of ``array`` whatever the other ranks' lengths, or ``None``."""
    shape = tuple(array.shape) if array.ndim else (1,)
    fits = (
        getattr(out, "dtype", None) == array.dtype
        and len(getattr(out, "shape", ())) == len(shape)
        and tuple(out.shape[1:]) == shape[1:]
        and out.flags.c_contiguous
        and out.flags.writeable
    )
    if fits:
        return None
    got = f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}"
    return ValueError(
        on_rank(
            rank,
            f"allgather of {name!r}: out= must be a writable contiguous {array.dtype} array of shape "
            f"(total length,) + {shape[1:]}, got {got}",
        )
    )


_SURVIVE_TRIES = 8  # further failures while the survivors rebuild: each one shrinks what is left

# Options that may differ between ranks: where this rank's arrays live, what it does on an error, how it judges
# and reports stragglers (the report's record slots are written alike whatever they are), and its timeline.
_LOCAL_OPTIONS = frozenset(
    {
        "device",
        "cuda_aware",
        "abort_on_error",
        "straggler_threshold",
        "straggler_window",
        "straggler_interval",
        "timeline",
    }
)


def _watchdog(rank: int, timeout: Optional[float], what: str) -> Optional[threading.Timer]:
    """Local (error path): a started timer that ends this rank as a dead one (:func:`leave_alone`) unless the
    survivors' rebuild after ``what`` is done within ``timeout`` seconds (``None``: no timer).

    On the side of a cut link that lacks a failure detector, Open MPI's shrink
    was seen to wait for ever (1 run in 8), and its nonblocking shrink crashed
    the process: a blocking shrink with this timer is what is left.
    """
    if timeout is None:
        return None

    def stuck() -> None:
        message = (
            f"the survivors did not rebuild the communicator within {timeout:g} s after {what} (ranks that "
            "cannot reach each other, as across a cut link, wait for each other in MPI's shrink); this rank "
            "stops as a dead one would, so that the others may carry on"
        )
        leave_alone([on_rank(rank, message)])

    timer = threading.Timer(timeout, stuck)
    timer.daemon = True
    timer.start()
    return timer


def _nothing(_: Optional[np.ndarray]) -> None:
    """The data stage of a call that a rank's error stops in its agreement (never reached)."""


def _shared_options(options: Options) -> tuple[str, ...]:
    """``name=value`` of every option that shapes the collectives, which every rank must share."""
    return tuple(
        f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options) if f.name not in _LOCAL_OPTIONS
    )


def _layout(array: Any, error: Optional[Exception]) -> tuple[str, tuple]:
    """(dtype char, shape) of a valid array argument, for its :class:`Call`."""
    return ("", ()) if error is not None else (array.dtype.char, tuple(array.shape))


def _names(names: Optional[Sequence[str]], n: int) -> Sequence[str]:
    return [f"array[{i}]" for i in range(n)] if names is None else names
