"""MPIStrategy: the user's entry point, one replica per MPI rank.

Ties the layers together: a :class:`~mpidist._comm.communicator.Communicator` for the
collectives, a :class:`~mpidist._comm.backend.Backend` for the arrays, the context
stack for replica / cross-replica code, and the variables' policies.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from mpidist._comm.abort import install_abort_on_error
from mpidist._comm.backend import Backend
from mpidist._comm.communicator import Communicator, Handle, duplicate_world
from mpidist._comm.flat_store import zeros_like_layout
from mpidist._comm.survival import release
from mpidist._comm.transport import duplicate
from mpidist._distribute.context import (
    call_arguments,
    checked_collective_context,
    checked_replica_context,
    enter_context,
)
from mpidist._distribute.extended import AnyReduceOp, StrategyExtended, is_array
from mpidist._distribute.mirrors import describe, diverged, fingerprint
from mpidist._distribute.preemption import DEFAULT_CHECK_EVERY, DEFAULT_SIGNALS, Stopper, signal_numbers
from mpidist._distribute.recovery import Snapshot, recover
from mpidist._distribute.variables import UPDATES, DistributedVariable, MirroredVariable, require_aggregation
from mpidist._errors import MirrorDivergenceError, on_rank
from mpidist._input.factories import distribute_dataset, distribute_datasets_from_function
from mpidist._input.multistep import run_steps_on_dataset
from mpidist._values.nest import flatten, is_number, map_structure
from mpidist._values.values import DistributedValues, PerReplica, regroup, select_replica, select_replica_mirrored

if TYPE_CHECKING:
    from mpi4py import MPI
    from numpy.typing import ArrayLike

__all__ = ["MPIStrategy"]


def _is_numeric_leaf(x: Any) -> bool:
    """Arrays and numbers: what ``run`` wraps as ``PerReplica``."""
    return is_array(x) or is_number(x)


class MPIStrategy:
    """Data-parallel SPMD strategy: each rank of ``comm`` is one replica.

    Construction is collective over ``comm``. Works in a plain ``python
    script.py`` (one replica) and under ``mpiexec -n N`` or ``srun``.

    Args:
        comm: the mpi4py communicator whose ranks are the replicas; default: a
            duplicate of ``MPI.COMM_WORLD``. mpidist's own traffic runs on a
            further private duplicate, so it never mixes with yours.
        **options: see :class:`~mpidist._options.Options`: ``timeout``
            (seconds before a collective that some ranks never join raises
            :class:`~mpidist.CollectiveTimeoutError`), ``check_collectives``,
            ``device`` (``"auto"``, ``"cpu"``, ``"gpu"``), ``cuda_aware``,
            ``piece_bytes``, ``check_finite``, ``abort_on_error`` (default
            on: an uncaught exception on any rank aborts the whole job with a
            rank-tagged traceback), ``check_mirrored_every``, ``fusion_bytes``,
            ``hierarchical``, ``node_size``, ``flat_variables``, ``compression``
            (``"fp16"``, ``"bf16"``: float32 reductions 16 bits on the wire;
            default ``None``, exact), ``timeline`` (a directory: every rank
            records its collectives, steps and input there; ``python -m
            mpidist timeline DIR`` merges them). Each defaults to its
            ``MPIDIST_*`` environment variable. Unknown options raise
            ``ValueError``.
    """

    _created = itertools.count(1)  # numbers the strategies of this process, for messages that name two

    def __init__(self, comm: Optional[MPI.Intracomm] = None, **options: Any) -> None:
        # created first: an option or environment variable that fails on one rank raises on every rank,
        # and a rank that never arrives costs the others a timeout, not a wait in MPI_Comm_dup forever
        communicator = Communicator(comm, overrides=options)
        self._set_up(communicator, duplicate_world() if comm is None else comm, comm is None, None)

    def _set_up(
        self, communicator: Communicator, comm: MPI.Intracomm, own_comm: bool, parent: Optional[MPIStrategy]
    ) -> None:
        """Local: the strategy around ``communicator``, whose ranks ``comm`` spans (freed with it if ``own_comm``)."""
        self._communicator = communicator
        communicator.hold_after_failure = True  # after ranks died, nothing runs before recover()
        self.options = communicator.options
        self._own_comm = own_comm
        self.comm = comm
        self._extended = StrategyExtended(self, communicator, self.options)
        self._stopper = Stopper(communicator)
        self._snapshot = Snapshot()
        self._origins = list(range(communicator.size))  # by rank now: its rank when created (ranks may die)
        self._number = next(MPIStrategy._created)
        # the strategies whose scope (or run) this one's scope may be entered in: those it was split from
        self._outer: tuple[MPIStrategy, ...] = () if parent is None else (parent, *parent._outer)
        if self.options.abort_on_error:
            install_abort_on_error()
        if communicator.timeline is not None:  # each step on the timeline, as this object's own attribute
            setattr(self, "run", communicator.timeline.timed(self.run, "step"))  # noqa: B010

    # -- identity (local) ----------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas: the communicator's size."""
        return self._communicator.size

    @property
    def rank(self) -> int:
        """This rank's replica id."""
        return self._communicator.rank

    @property
    def backend(self) -> Backend:
        """Where this rank's components live (NumPy, or CuPy on its GPU)."""
        return self._communicator.backend

    @property
    def communicator(self) -> Communicator:
        """The array communicator running mpidist's collectives."""
        return self._communicator

    @property
    def extended(self) -> StrategyExtended:
        """The strategy's collectives on components, as variables, contexts and checkpoints use them."""
        return self._extended

    def __repr__(self) -> str:
        of = f", a process set of #{self._outer[0]._number}" if self._outer else ""
        return f"<MPIStrategy #{self._number}: rank {self.rank} of {self.num_replicas_in_sync}, {self.backend!r}{of}>"

    def free(self) -> None:
        """Collective: complete the nonblocking collectives still in flight, then release the communicators this
        strategy created. A second call does nothing."""
        self._communicator.free()
        if self._own_comm:
            self._own_comm = False
            self.comm.Free()

    # -- surviving dead ranks (fault_tolerance) --------------------------------------------------
    def snapshot(self, **state: Any) -> None:
        """Local: mark the start of a step, to return to should ranks die before the next snapshot.

        Copies every mirrored variable of this strategy (one pass over their
        memory, into buffers reused from the last snapshot) and keeps
        ``state``, the program's position as keywords of JSON values (an
        epoch, a step, an input iterator's ``get_state()``). Take it at the
        same point on every rank, at the start of each step. When ranks die,
        :meth:`recover` returns every survivor to the newest snapshot any of
        them took and returns its ``state``. Only with ``fault_tolerance``
        does a snapshot serve; it costs the copy either way.
        """
        self._snapshot.take(self._extended.variables(), state, self.rank)

    def recover(self) -> dict[str, Any]:
        """Collective over the survivors, after :class:`~mpidist.RankFailedError`: carry on with them.

        The strategy already runs over the survivors (renumbered in their old
        order: :attr:`rank` and :attr:`num_replicas_in_sync` say where this
        rank stands now), but until this call its collectives raise the
        ``RankFailedError`` again. This makes what they hold alike: with
        :meth:`snapshot`, every survivor returns to the newest snapshot any of
        them took (its mirrored variables, bit for bit) and gets its
        ``state``; without, every mirrored variable takes the values of a
        survivor on which the collective in flight completed. Returns the
        ``state`` (``{}`` without a snapshot). Sync-on-read variables keep
        each survivor's own part; the dead ranks' parts are lost. Distributed
        datasets are bound to the old ranks: distribute them again and
        continue from the position in ``state`` (``iterator_from_state``).
        Should more ranks die meanwhile, it recovers from that too. Raises
        ``RuntimeError`` when no rank died (or fault tolerance is off). See docs/fault-tolerance.md.
        """
        checked_collective_context(self, "strategy.recover")
        state = recover(self._communicator, self._extended.variables(), self._snapshot, self._origins)
        if self._own_comm:  # the duplicate of MPI.COMM_WORLD made for the user: one of the survivors instead
            dead, self.comm = self.comm, duplicate(self._communicator.mpi_comm, self.options.timeout)
            release(dead)
        return state

    def split(self, color: Optional[int], key: Optional[int] = None, **options: Any) -> Optional[MPIStrategy]:
        """Collective over this strategy's ranks: a strategy over the ranks that pass the same ``color``.

        A *process set*: the ranks of one colour (a non-negative integer) are
        its replicas, ordered by ``key`` (default: their rank here); every
        rank passes its own colour, and ``color=None`` joins no set (the
        result is then ``None``). Each set has its own communicators
        (:attr:`comm`, and the :attr:`communicator` its collectives run on)
        with their own agreement, so collectives of different sets, and of
        this strategy, never match each other. ``options`` override the
        options this strategy was created with; the ranks of each set agree
        on them (see :meth:`~mpidist.Communicator.split`).

        Use the set's strategy inside its own ``scope()``, which may be
        entered inside the scope (or ``run``) of the strategy it was split
        from; in there, this strategy's collective methods raise
        ``RuntimeError``, as another strategy's do. Its :attr:`communicator`
        can be used anywhere. :meth:`free` (collective over the set) releases
        it; it does not depend on this strategy, which may be freed first.
        """
        checked_collective_context(self, "strategy.split")
        communicator = self._communicator.split(color, key, **options)
        if communicator is None:
            return None
        strategy = MPIStrategy.__new__(MPIStrategy)
        strategy._set_up(communicator, duplicate(communicator.mpi_comm, communicator.options.timeout), True, self)
        return strategy

    # -- contexts ------------------------------------------------------------------------
    def scope(self) -> AbstractContextManager[MPIStrategy]:
        """Context manager: cross-replica context of this strategy (variables are created here). Local.

        ``with strategy.scope() as s`` gives the strategy. The object may be
        entered again, also nested in itself; inside the scope (or ``run``)
        of another strategy it raises ``RuntimeError`` naming both, unless this
        strategy was split from that one (:meth:`split`).
        """
        return enter_context(self, within=self._outer)

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Call ``fn`` in replica context on this rank.

        ``PerReplica`` arguments (also inside lists, tuples and dicts) are
        replaced by this rank's component (also when they hold components of
        other replicas too); everything else is passed as it is. The return
        value keeps its structure, with arrays and numbers wrapped as
        ``PerReplica``; a variable (or its component) comes back as the
        variable, any other object as it is. Collective only if ``fn``
        makes collective calls (``merge_call``, updates of mirrored variables).
        """

        def unwrap(x: Any) -> Any:
            return x.get(self.rank) if isinstance(x, PerReplica) and not isinstance(x, DistributedVariable) else x

        left = self._communicator.steps_left
        try:  # whatever fails on this rank alone (its context, arguments, fn): its next collective says so everywhere
            if checked_replica_context(self, "strategy.run") is not None:
                raise RuntimeError(
                    on_rank(self.rank, "strategy.run was called inside strategy.run; call fn directly instead")
                )
            args, kwargs = call_arguments("strategy.run", self.rank, args, kwargs)
            args = map_structure(unwrap, args)
            kwargs = map_structure(unwrap, kwargs)
            with enter_context(self, self._extended.replica_context(), "strategy.run"):
                result = fn(*args, **kwargs)
        except BaseException as exc:
            self._communicator.left_step("strategy.run", left, exc)
            raise
        return regroup({self.rank: result}, PerReplica, wrap_identical=_is_numeric_leaf)

    # -- cross-replica collectives -----------------------------------------------------------
    def reduce(
        self,
        reduce_op: AnyReduceOp,
        value: Any,
        axis: Optional[int] = None,
        *,
        out: Any = None,
        compression: Optional[str] = None,
    ) -> Any:
        """Collective: reduce ``value`` across replicas; the result is identical on every rank.

        ``reduce_op`` is a ``ReduceOp`` or a ``VariableAggregation`` (or the
        name of either): ``SUM``/``MEAN`` as the ``ReduceOp``,
        ``ONLY_FIRST_REPLICA`` gives replica 0's value on every rank, ``NONE``
        raises ``ValueError``. ``value`` is a ``PerReplica``, a ``Mirrored``
        (or variable), a plain array or number, or a list/tuple/dict of those
        (reduced together); a distributed value contributes this rank's
        component, also when it holds other replicas' too.
        Returns plain arrays of the components' module. With ``axis``, each
        component is first reduced along that axis; ``MEAN`` is then the mean
        over all elements of the global batch, also when replicas hold
        different numbers of elements. ``out`` (a nest like ``value`` of
        arrays shaped like its components, without ``axis``) receives the
        result instead of new arrays: the form that allocates nothing in
        steady state, for repeated reductions of the same layout.
        ``compression`` (``"fp16"``, ``"bf16"``, ``"none"``; ``None``: the
        strategy's option) sends float32 ``SUM``/``MEAN`` values over the wire
        in 16 bits (``docs/compression.md``); asked for here, every value must
        be float32 (else ``ValueError``).
        """
        checked_collective_context(self, "strategy.reduce")
        return self._extended.reduce(reduce_op, value, axis, out, compression)

    def reduce_async(self, reduce_op: AnyReduceOp, value: Any) -> Handle:
        """Collective, nonblocking :meth:`reduce` (without ``axis``): returns a :class:`~mpidist.Handle`.

        ``handle.wait()`` returns what :meth:`reduce` would. The values are
        copied when the call starts, so they may change afterwards; compute
        while the reduction runs and call ``wait()`` when the result is
        needed. The reduction advances while this rank is inside MPI
        (``handle.test()`` drives it); see the docs for what each MPI library
        does in the background.
        """
        checked_collective_context(self, "strategy.reduce_async")
        return self._extended.reduce_async(reduce_op, value)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Collective: concatenate all replicas' components along ``axis``, in replica order.

        ``value`` is a distributed value, an array or number, or a nest
        (list, tuple, dict) of those, each leaf gathered on its own.
        Components may differ in length along ``axis``; the other dimensions
        must agree; a 0-d component gives one element per replica. Every rank
        gets the whole result: plain arrays in the nest's structure.
        """
        checked_collective_context(self, "strategy.gather")
        return self._extended.gather(value, axis)

    def broadcast(self, value: ArrayLike, root: int = 0) -> Any:
        """Collective: root's ``value`` (an array or number, the same shape on every rank) on every rank."""
        checked_collective_context(self, "strategy.broadcast")
        try:
            array = self.backend.asarray(self._extended.local(value)).copy()
        except Exception as exc:  # a value that cannot be converted: raised on every rank
            self._communicator.fail(exc, "broadcast")
        return self._communicator.broadcast(array, root=root, name="broadcast")

    def barrier(self) -> None:
        """Collective: wait until every rank has arrived (honours the timeout)."""
        checked_collective_context(self, "strategy.barrier")
        self._communicator.barrier()

    # -- coordinated stop (preemption) -----------------------------------------------------
    def request_stop(self) -> None:
        """Local: ask every rank to stop at the same step; safe inside a signal handler.

        The request rides the next collective's agreement record, so every
        rank's :meth:`should_stop` turns ``True`` after the same collective,
        with no extra message (see :mod:`mpidist._distribute.preemption`).
        """
        self._stopper.request()

    def should_stop(self, check_every: int = DEFAULT_CHECK_EVERY) -> bool:
        """Whether every rank has agreed to stop; ``True`` from the same step on, on every rank.

        Call it once per step on every rank, between steps; when it is
        ``True``, save a checkpoint (collective) and return. Local with
        collective checks on (the default): it reads what the step's
        collectives carried. With every check off (``check_collectives=False,
        timeout=None``) every ``check_every``-th call is a collective (one
        allreduce of one integer), so a stop is seen up to ``check_every``
        calls after it was requested.
        """
        return self._stopper.should_stop(check_every)

    def stop_on_signals(self, *signals: Union[int, str]) -> dict[int, Any]:
        """Local: make these signals (default ``SIGUSR1`` and ``SIGTERM``) call :meth:`request_stop`.

        Signals are ``signal.SIGUSR1``, numbers or names (``"USR1"``). Call it
        in the main thread, on every rank, early: a signal that arrives before
        the handler is installed still ends the process. Returns the previous
        handlers, ``{signal number: handler}``. The last signal that asked for
        a stop on this rank is :attr:`stop_signal`.
        """
        return self._stopper.install(signal_numbers(signals) if signals else DEFAULT_SIGNALS)

    @property
    def stop_signal(self) -> Optional[int]:
        """The number of the last signal that asked this rank to stop (``None``: none did). Local."""
        return self._stopper.signal

    # -- input (the data layer does the work) ------------------------------------------------
    def distribute_dataset(self, dataset: Any, auto_shard: bool = True, **options: Any) -> Any:
        """Shard ``dataset`` over the replicas: see :func:`mpidist._input.factories.distribute_dataset`.

        At step ``s`` rank ``r`` gets element ``s * N + r`` (every element
        without ``auto_shard``); an :class:`~mpidist.ArrayDataset` gives each
        rank ``global_batch_size / N`` rows per step. Every rank runs the same
        number of steps. Iterating is collective when the length is unknown.
        """
        checked_replica_context(self, "strategy.distribute_dataset")
        return distribute_dataset(self, dataset, auto_shard, **options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], **options: Any) -> Any:
        """Call ``dataset_fn(InputContext)`` on each rank and iterate what it returns in step.

        See :func:`mpidist._input.factories.distribute_datasets_from_function`.
        """
        checked_replica_context(self, "strategy.distribute_datasets_from_function")
        return distribute_datasets_from_function(self, dataset_fn, **options)

    def run_steps_on_dataset(self, fn: Callable[..., Any], iterator: Iterator[Any], iterations: int) -> Any:
        """Run ``fn(ctx, inputs)`` for up to ``iterations`` steps; returns the ``MultiStepContext``.

        See :func:`mpidist._input.multistep.run_steps_on_dataset`.
        """
        checked_replica_context(self, "strategy.run_steps_on_dataset")
        return run_steps_on_dataset(
            fn,
            iterator,
            iterations,
            rank=self.rank,
            run=self.run,
            reduce=self.reduce,
            check_reduce_op=self._extended.reduce_op,
        )

    def experimental_local_results(self, value: Any) -> tuple:
        """Local: the local replicas' components of ``value``, one per replica (under MPI: this rank's), as a tuple.

        A distributed value gives its components; a nest holding distributed
        values gives one nest per replica with each of them replaced by that
        replica's component (``({'a': 1.0, 'b': 2.0},)`` for what a ``run``
        returning that dict gives); a value without any gives ``(value,)``.
        """
        if isinstance(value, DistributedValues):
            return value.values
        ids = sorted(
            {rid for leaf in flatten(value) if isinstance(leaf, DistributedValues) for rid in leaf.replica_ids}
        )
        return tuple(select_replica(rid, value) for rid in ids) if ids else (value,)

    def update(self, var: DistributedVariable, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Cross-replica: call ``fn(component, *args, **kwargs)`` on every rank; ``fn`` updates in place.

        ``Mirrored`` arguments are replaced by their local component (a
        ``PerReplica`` argument raises ``TypeError``: reduce it first).
        Returns what ``fn`` returns. Local, but every rank must make the same
        updates to keep a mirrored variable's components identical.
        """
        self._check_variable(var, "update")
        args, kwargs = select_replica_mirrored(self.rank, (args, kwargs))
        return fn(var.component, *args, **kwargs)

    def batch_update(
        self,
        pairs: Iterable[tuple[MirroredVariable, Any]],
        fn: Union[str, Callable[[Any, Any], Any]] = "assign_add",
        *,
        in_place: bool = False,
        compression: Optional[str] = None,
    ) -> list[MirroredVariable]:
        """Update many mirrored variables at once: ``fn(component, value)`` for each ``(variable, value)``.

        ``fn`` is ``"assign"``, ``"assign_add"``, ``"assign_sub"`` or a
        function that updates its first argument in place, elementwise (for
        example ``lambda w, g: w.__isub__(0.1 * g)``): it may be called on flat
        slices of several components at once, with the matching slice of the
        values, which it must not keep.

        - Replica context (inside ``run``): collective. Each value is
          reduced by its variable's aggregation (``SUM``, ``MEAN``,
          ``ONLY_FIRST_REPLICA``), all of them together: values that lie
          back to back in memory, as do their variables (``flat_variables``
          with :meth:`flat_zeros_like` values), are reduced where they are as
          one span, in pieces; the others share MPI calls through reusable
          buckets (``fusion_bytes``). Then the same ``fn`` runs on every
          rank, so components stay identical. Aggregation ``NONE`` raises
          ``ValueError``. Every rank passes the same variables in the same
          order.
        - Cross-replica context: each value is applied as given (local).

        Returns the variables. The values are not modified, unless
        ``in_place``: then each value that is an array of its variable's
        dtype and shape is overwritten with its aggregated value (for
        example the mean gradient), and the reduction needs no scratch copy:
        the fastest way to update from large or flat gradient buffers.
        ``compression`` (replica context): as in :meth:`reduce`, for every
        value (each variable's aggregation SUM or MEAN, float32).
        """
        pairs = list(pairs)
        variables = [v for v, _ in pairs]
        for v in variables:
            if not isinstance(v, MirroredVariable):
                raise TypeError(f"strategy.batch_update expects mirrored variables, got {type(v).__name__} {v!r}")
            if v.strategy is not self:
                raise ValueError(
                    f"strategy.batch_update: variable {v.name!r} belongs to another strategy, {v.strategy!r}"
                )
        update = UPDATES[fn] if isinstance(fn, str) else fn
        values = [x for _, x in pairs]
        if checked_replica_context(self, "strategy.batch_update") is None:
            for v, x in zip(variables, values):
                update(v.component, v.coerce(x))
            return variables
        for v in variables:
            require_aggregation(v, "strategy.batch_update")
        self._extended.update_mirrored(variables, values, update, in_place, compression)
        return variables

    def flat_zeros_like(self, variables: Sequence[DistributedVariable]) -> list[Any]:
        """Local: zero-filled arrays shaped like the variables, laid out in memory like their components.

        With ``flat_variables``, variables created one after another lie back
        to back in a few large buffers; arrays from this call do too, in the
        same order. Compute gradients into them (``g[...] = ...``) and
        :meth:`batch_update` reduces them with no packing copy.
        """
        return zeros_like_layout([v.component for v in variables], self.backend.xp)

    def read_var(self, var: DistributedVariable) -> Any:
        """The variable's cross-replica value (collective for sync-on-read variables)."""
        self._check_variable(var, "read_var")
        with self.scope():
            return var.read_value()

    def _check_variable(self, var: Any, what: str) -> None:
        if not isinstance(var, DistributedVariable):
            raise TypeError(
                f"strategy.{what} expects a variable created with mpidist.Variable, got {type(var).__name__}"
            )
        if var.strategy is not self:
            raise ValueError(f"strategy.{what}: variable {var.name!r} belongs to another strategy, {var.strategy!r}")
        if checked_replica_context(self, f"strategy.{what}") is not None:
            raise RuntimeError(
                f"strategy.{what} is a cross-replica call; inside strategy.run use get_replica_context().merge_call"
            )

    def check_mirrored(self, variables: Any, *, repair: bool = False) -> dict[str, tuple[int, ...]]:
        """Collective: verify that mirrored variables are identical on every rank.

        Compares a CRC-32 of each variable's component bytes across ranks (one
        small allgather for all of them). ``variables`` is a nest (list, dict,
        ...) of :class:`MirroredVariable`, passed in the same order on every
        rank.

        Returns ``{}`` when all agree. When some differ, raises
        :class:`~mpidist.MirrorDivergenceError` naming each variable and the
        ranks whose component differs from rank 0's; with ``repair=True``
        instead broadcasts rank 0's values into the diverged variables, warns,
        and returns ``{name: diverged ranks}``.
        """
        checked_collective_context(self, "strategy.check_mirrored")
        flat = flatten(variables)
        for v in flat:
            if not isinstance(v, MirroredVariable):
                raise TypeError(f"check_mirrored expects mirrored variables, got {type(v).__name__} {v!r}")
            self._check_variable(v, "check_mirrored")
        sums = np.array([[fingerprint(v.component) for v in flat]], dtype=np.int64)
        differ = diverged([v.name for v in flat], self._communicator.allgather(sums, name="mirror checksums"))
        if not differ:
            return {}
        report = describe(differ)
        if not repair:
            raise MirrorDivergenceError(
                on_rank(
                    self.rank,
                    f"{report}. Replicas must apply "
                    "the same updates (update mirrored variables only through assign*/strategy.update with the "
                    "same values on every rank); check_mirrored(..., repair=True) re-broadcasts rank 0's values.",
                ),
                differ,
            )
        for v in flat:
            if v.name in differ:
                self._extended.broadcast_from_first(v.component, name=v.name)
        if self.rank == 0:
            warnings.warn(on_rank(None, f"repaired from rank 0's values: {report}"), RuntimeWarning, stacklevel=2)
        return differ
