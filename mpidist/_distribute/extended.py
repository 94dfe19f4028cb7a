"""What the distribute layer needs from a strategy: ``strategy.extended``.

Variables, contexts and checkpoints reach the strategy's collectives through
this one surface, never through the strategy's private methods. It combines
per-replica components into cross-replica values (reductions, aggregation,
the initial broadcast of a variable), applies fused mirrored updates, and
places new mirrored components (in flat storage when ``flat_variables`` is
on). Every reduction runs on the strategy's
:class:`~mpidist.Communicator`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from mpidist._comm.backend import array_module, as_array, contiguous
from mpidist._comm.communicator import Communicator, Handle
from mpidist._comm.flat_store import FlatStore
from mpidist._comm.reduce_op import ReduceOp
from mpidist._distribute.context import ReplicaContext, call_arguments, enter_context
from mpidist._distribute.variables import DistributedVariable, VariableAggregation
from mpidist._errors import on_rank
from mpidist._options import Options
from mpidist._values.nest import flatten, leaf_paths, map_structure, pack_sequence_as
from mpidist._values.values import DistributedValues, PerReplica, regroup

if TYPE_CHECKING:
    from mpidist._distribute.strategy import MPIStrategy
    from mpidist._typing import Array

__all__ = ["StrategyExtended"]

UpdateFn = Callable[["Array", "Array"], Any]  # fn(component, reduced value), see update_mirrored
AnyReduceOp = Union[ReduceOp, VariableAggregation, str]

# How a variable's aggregation combines the replicas' values; None: replica 0's value. NONE
# combines as SUM: how a sync-on-read variable without aggregation reads.
_AGGREGATION_OPS = {
    VariableAggregation.SUM: ReduceOp.SUM,
    VariableAggregation.NONE: ReduceOp.SUM,
    VariableAggregation.MEAN: ReduceOp.MEAN,
    VariableAggregation.ONLY_FIRST_REPLICA: None,
}


class StrategyExtended:
    """The strategy's collectives on components, for the variables, contexts and checkpoints.

    Local construction (the strategy builds it); the methods say which are collective.
    """

    def __init__(self, strategy: MPIStrategy, communicator: Communicator, options: Options) -> None:
        # weakly: the strategy holds this object, and a cycle would leave its end to the garbage collector
        self._owner = weakref.ref(strategy)
        self._comm = communicator
        self._flat = FlatStore(communicator.backend.xp) if options.flat_variables else None
        self._check_every = options.check_mirrored_every
        self._unnamed = 0
        self._variables: list[weakref.ref[DistributedVariable]] = []  # in creation order (the same on every rank)

    @property
    def _strategy(self) -> MPIStrategy:
        strategy = self._owner()
        if strategy is None:
            raise RuntimeError(on_rank(self._comm.rank, "strategy.extended outlived its strategy, which was deleted"))
        return strategy

    def track(self, variable: DistributedVariable) -> None:
        """Local: remember ``variable`` (weakly) among the strategy's variables (for :meth:`variables`)."""
        if len(self._variables) % 64 == 63:
            self._variables = [ref for ref in self._variables if ref() is not None]
        self._variables.append(weakref.ref(variable))

    def variables(self) -> list[DistributedVariable]:
        """Local: the strategy's variables still alive, in creation order (the same on every rank)."""
        return [v for v in (ref() for ref in self._variables) if v is not None]

    def default_name(self) -> str:
        """Local: the next default variable name of this strategy: ``"Variable"``, ``"Variable_1"``, ..."""
        name = "Variable" if self._unnamed == 0 else f"Variable_{self._unnamed}"
        self._unnamed += 1
        return name

    @property
    def communicator(self) -> Communicator:
        """The communicator every collective of the strategy runs on."""
        return self._comm

    # -- components -----------------------------------------------------------------------
    def local(self, value: Any) -> Array:
        """Local: this rank's component of ``value`` (a distributed value, an array, a number, ...) as a NumPy or
        CuPy array: another library's array as a view of its memory, numbers and lists in the backend's module."""
        if isinstance(value, DistributedValues):
            value = value.get(self._comm.rank)
        value = as_array(value, "value", self._comm.rank)
        if hasattr(value, "dtype") and hasattr(value, "shape"):
            return value
        return self._comm.backend.asarray(value)  # a number or a list: as_array left it as it is

    def place(self, component: Array) -> Array:
        """Local: where a new mirrored variable keeps ``component`` (a view of flat storage with ``flat_variables``)."""
        if self._flat is None:
            return component
        placed = self._flat.zeros(component.shape, component.dtype)
        placed[...] = component
        return placed

    # -- reductions -------------------------------------------------------------------------
    def reduce_op(self, reduce_op: AnyReduceOp) -> Optional[ReduceOp]:
        """Local: the ``ReduceOp`` of a ``ReduceOp``, a ``VariableAggregation`` or a name of either.

        ``SUM``/``MEAN`` aggregations give that ``ReduceOp``; ``ONLY_FIRST_REPLICA`` gives
        ``None`` (replica 0's value); ``NONE`` raises ``ValueError``.
        """
        if isinstance(reduce_op, str):
            try:
                aggregation = VariableAggregation(reduce_op.lower())
            except ValueError:
                return self._op(reduce_op)
            reduce_op = aggregation
        if isinstance(reduce_op, VariableAggregation):
            if reduce_op is VariableAggregation.NONE:
                raise ValueError(
                    on_rank(
                        self._comm.rank,
                        "VariableAggregation.NONE does not say how to combine "
                        "the replicas' values; reduce with SUM, MEAN or ONLY_FIRST_REPLICA",
                    )
                )
            return _AGGREGATION_OPS[reduce_op]
        return self._op(reduce_op)

    def _op(self, reduce_op: Union[ReduceOp, str]) -> ReduceOp:
        try:
            return ReduceOp.of(reduce_op)
        except ValueError as exc:
            raise ValueError(on_rank(self._comm.rank, str(exc))) from None

    def reduce(
        self,
        reduce_op: AnyReduceOp,
        value: Any,
        axis: Optional[int] = None,
        out: Any = None,
        compression: Optional[str] = None,
    ) -> Any:
        """Collective: ``value`` (a nest) reduced across replicas; see :meth:`MPIStrategy.reduce`.

        Every argument is checked before any collective; a problem on one rank
        (an unknown op, an axis out of range, a value that cannot be converted,
        whatever the exception) is raised on that rank and reported to the
        others as a mismatch naming it. Each leaf's name carries its path in
        the nest and the axis, so ranks whose nests differ in structure or keys,
        or whose axes differ, disagree instead of pairing off. ``out=`` changes
        where the results go, never the call. ``compression``: see
        :meth:`~mpidist.Communicator.allreduce`.
        """
        rank = self._comm.rank
        try:
            op = self.reduce_op(reduce_op)
            if op is None and axis is not None:
                raise ValueError(
                    on_rank(
                        rank,
                        "ONLY_FIRST_REPLICA takes replica 0's value as it "
                        f"is; it has no axis to reduce along (got axis={axis})",
                    )
                )
            leaves, paths = flatten(value), leaf_paths(value)
            names = [f"reduce{path}" for path in paths]
            outs = None if out is None else flatten(out)
            if outs is not None and (op is None or axis is not None):
                raise ValueError(on_rank(rank, "out= takes a SUM/MEAN/MIN/MAX/PROD reduction without axis"))
            if op is None and compression is not None:
                raise ValueError(
                    on_rank(rank, f"compression={compression!r} applies to SUM and MEAN, not ONLY_FIRST_REPLICA")
                )
            if outs is not None and len(outs) != len(leaves):
                raise ValueError(on_rank(rank, f"out= holds {len(outs)} arrays for the {len(leaves)} values reduced"))
            if op is None:
                xp = self._comm.backend.xp  # new arrays (also of NumPy scalars), which the broadcast overwrites
                arrays = [xp.array(self.local(x)) for x in leaves]
            elif axis is None:
                arrays = [self._prepared(op, x) for x in leaves]
            else:
                sums = []
                for i, x in enumerate(leaves):
                    local = self.local(x)
                    along = normalize_axis(axis, local.ndim, rank)
                    sums.append(self._axis_sum(op, local, along))
                    names[i] = f"reduce(axis={along}){paths[i]}"
        except Exception as exc:  # any failure of this rank's arguments is raised on every rank
            self._comm.fail(exc, "reduce")
        if op is None:
            return pack_sequence_as(
                value, [self._comm.broadcast(a, root=0, name=name) for a, name in zip(arrays, names)]
            )
        if axis is None and len(arrays) == 1:  # the common case: one array, one agreement record
            return pack_sequence_as(
                value,
                [
                    self._comm.allreduce(
                        arrays[0], op, name=names[0], out=None if outs is None else outs[0], compression=compression
                    )
                ],
            )
        if axis is None:  # all leaves together: few MPI calls, one agreement record
            return pack_sequence_as(
                value, self._comm.allreduce_many(arrays, op, names, out=outs, compression=compression)
            )
        results = []
        for (total, count), name in zip(sums, names):
            total = self._comm.allreduce(total, ReduceOp.SUM, name=name, compression=compression)
            if op is ReduceOp.MEAN:
                total /= int(self._comm.allreduce(count, ReduceOp.SUM, name=f"{name} (count)"))
            results.append(total)
        return pack_sequence_as(value, results)

    def reduce_async(self, reduce_op: AnyReduceOp, value: Any) -> Handle:
        """Collective, nonblocking :meth:`reduce` (without ``axis``).

        ``ONLY_FIRST_REPLICA`` runs as a sum to which the other replicas add zeros.
        """
        op = self.reduce_op(reduce_op)
        arrays = [self._prepared(op or ReduceOp.SUM, leaf) for leaf in flatten(value)]
        if op is None:
            op = ReduceOp.SUM
            if self._comm.rank != 0:
                arrays = [array_module(a).zeros_like(a) for a in arrays]
        return self._comm.iallreduce_many(
            arrays,
            op,
            [f"reduce_async[{i}]" for i in range(len(arrays))],
            then=lambda results: pack_sequence_as(value, results),
        )

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Collective: each leaf of ``value`` (a nest) concatenated over the replicas along ``axis``, in replica
        order; see :meth:`MPIStrategy.gather`.

        Leaves may differ in length along ``axis`` between replicas; a 0-d leaf
        gives one element per replica. Every leaf is checked before any
        collective (a problem on one rank is raised there and reported to the
        others). Each leaf's name carries its path, its axis and, for a nest,
        the number of leaves, so ranks whose nests differ disagree in the first
        gather instead of pairing off.
        """
        rank = self._comm.rank
        try:
            leaves, paths = flatten(value), leaf_paths(value)
            count = f" (of {len(leaves)})" if len(leaves) != 1 or paths[0] else ""
            moved: list[Array] = []  # each leaf with its gathered axis first
            axes: list[Optional[int]] = []  # None: a 0-d leaf, one element per replica
            names: list[str] = []
            for x, path in zip(leaves, paths):
                local = self.local(x)
                if local.ndim == 0:
                    moved.append(local)
                    axes.append(None)
                    names.append(f"gather{path}{count}")
                    continue
                along = normalize_axis(axis, local.ndim, rank)  # part of the call's name: every rank alike
                moved.append(contiguous(array_module(local).moveaxis(local, along, 0)))
                axes.append(along)
                names.append(f"gather(axis={along}){path}{count}")
        except Exception as exc:  # any failure of this rank's argument is raised on every rank
            self._comm.fail(exc, "gather")
        results = []
        for array, moved_axis, name in zip(moved, axes, names):
            gathered = self._comm.allgather(array, name=name)
            results.append(gathered if moved_axis is None else array_module(gathered).moveaxis(gathered, 0, moved_axis))
        return pack_sequence_as(value, results)

    def alltoall(self, value: Any, splits: Optional[Any] = None) -> tuple[Any, np.ndarray]:
        """Collective: the rows of this replica's component of ``value`` dealt out to the replicas; returns
        ``(received, received_splits)``, this replica's.

        :meth:`Communicator.alltoall <mpidist.Communicator.alltoall>` on the component: ``splits[r]``
        rows to replica ``r`` (``None``: even splits). TensorFlow's strategies have no alltoall;
        this one works in both contexts: in cross-replica context on a distributed value (this
        rank's component), and inside ``strategy.run`` on the replica's own arrays (``run``
        returns what ``fn`` returns as ``PerReplica`` values).
        """
        return self._comm.alltoall(self.local(value), splits, name="alltoall")

    def aggregate(self, aggregation: VariableAggregation, value: Array, name: str) -> Any:
        """Collective: ``value`` combined across replicas by a variable's ``aggregation`` (a new array).

        Exact whatever the strategy's ``compression``: what a sync-on-read variable reads and saves.
        """
        local = self.local(value)
        op = _AGGREGATION_OPS[aggregation]
        if op is None:
            return self._comm.broadcast(local.copy(), root=0, name=name)
        return self._comm.allreduce(local, op, name=name, compression="none")

    def broadcast_from_first(self, array: Array, name: str) -> None:
        """Collective: overwrite ``array`` with replica 0's, in place."""
        self._comm.broadcast(array, root=0, name=name)

    def update_mirrored(
        self,
        variables: Sequence[DistributedVariable],
        values: Sequence[Any],
        fn: UpdateFn,
        in_place: bool = False,
        compression: Optional[str] = None,
    ) -> None:
        """Collective: ``fn(component, value reduced by the variable's aggregation)`` for each, fused.

        Each value is first fitted to its variable's shape and dtype; a value
        that does not fit (whatever the exception) raises it on this rank
        and a :class:`~mpidist.CollectiveMismatchError` naming this rank on the
        others, in the same agreement step. The variables' names are part of
        what the ranks agree on. Then, when due, the periodic
        ``check_mirrored`` of ``options.check_mirrored_every``. ``compression``:
        see :meth:`~mpidist.Communicator.reduce_apply`.
        """
        error: Optional[Exception] = None
        if len(variables) == 1:  # the per-update path: no lists
            v = variables[0]
            component = v.component
            try:
                value = v.coerce(values[0])
            except Exception as exc:  # whatever fails, every rank raises in the same call
                error, value = exc, component  # not sent: the agreement fails first
            self._comm.reduce_apply(
                (value,), (component,), (_AGGREGATION_OPS[v.aggregation],), fn, (v.name,), in_place, error, compression
            )
        else:
            try:
                values = tuple(v.coerce(x) for v, x in zip(variables, values))
            except Exception as exc:  # whatever fails, every rank raises in the same call
                error = exc
                values = tuple(v.component for v in variables)
            self._comm.reduce_apply(
                values,
                [v.component for v in variables],
                [_AGGREGATION_OPS[v.aggregation] for v in variables],
                fn,
                [v.name for v in variables],
                in_place,
                error,
                compression,
            )
        if self._check_every:
            self._check_mirrored_when_due(variables)

    def update_one(self, v: DistributedVariable, value: Any, fn: UpdateFn) -> None:
        """Collective: :meth:`update_mirrored` of one variable, the per-update path of training loops.

        Small variables take the communicator's prepared update
        (:meth:`~mpidist.Communicator.prepare_update`), kept on the variable
        per update function; the others, and a value that does not fit,
        :meth:`update_mirrored`.
        """
        comm = self._comm
        entry = v.prepared_updates.get(fn)
        if entry is None or entry[0] != comm.generation:
            op = _AGGREGATION_OPS[v.aggregation]
            entry = v.prepared_updates[fn] = (comm.generation, comm.prepare_update(v.component, op, fn, v.name))
        update = entry[1]
        if update is not None:
            try:
                fitted = v.coerce(value)
            except Exception:  # update_mirrored raises it here, and a mismatch naming this rank on the others
                update = None
        if update is None:
            self.update_mirrored((v,), (value,), fn)
            return
        update(fitted, v.component)
        if self._check_every:
            self._check_mirrored_when_due((v,))

    def _check_mirrored_when_due(self, variables: Sequence[DistributedVariable]) -> None:
        """Collective: ``check_mirrored`` of the variables whose update count reached a multiple of the period."""
        due = [v for v in variables if v.count_update() % self._check_every == 0]
        if due:
            with self._strategy.scope():
                self._strategy.check_mirrored(due)

    # -- contexts -----------------------------------------------------------------------------
    def merge_call(self, merge_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Collective: ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context; see
        ``ReplicaContext.merge_call``."""
        rank = self._comm.rank
        left = self._comm.steps_left
        try:  # whatever fails on this rank alone (its arguments, merge_fn): its next collective says so on every rank
            args, kwargs = call_arguments("merge_call", rank, args, kwargs)
            wrapped = regroup({rank: (args, kwargs)}, PerReplica, wrap_identical=is_array)
            with enter_context(self._strategy, None, "merge_call"):
                result = merge_fn(self._strategy, *wrapped[0], **wrapped[1])
        except BaseException as exc:
            self._comm.left_step("merge_call", left, exc)
            raise

        def keep_variables(x: Any) -> Any:
            if isinstance(x, DistributedVariable):
                return x
            return x.get(rank) if isinstance(x, DistributedValues) else x

        return map_structure(keep_variables, result)

    def replica_context(self) -> ReplicaContext:
        """Local: a new replica context of this rank."""
        return ReplicaContext(self._strategy, self._comm.rank)

    # -- helpers ------------------------------------------------------------------------------
    def _prepared(self, op: ReduceOp, value: Any) -> Array:
        """This rank's component of ``value`` as a contiguous array ``op`` can reduce (MEAN of integers: float64)."""
        local = self.local(value)
        if op is ReduceOp.MEAN and local.dtype.kind in "iub":
            local = local.astype(np.float64)
        return contiguous(local)

    @staticmethod
    def _axis_sum(op: ReduceOp, local: Array, axis: int) -> tuple[Array, np.ndarray]:
        """Local: this rank's sum along ``axis`` and its element count there (for ``MEAN``)."""
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise ValueError(f"reduce with axis= supports SUM and MEAN, not {op.name}")
        if op is ReduceOp.MEAN and local.dtype.kind in "iub":
            local = local.astype(np.float64)
        return contiguous(local.sum(axis=axis)), np.array(local.shape[axis], dtype=np.int64)


def normalize_axis(axis: Any, ndim: int, rank: int) -> int:
    """Local: ``axis`` of an array of ``ndim`` dimensions as a number in ``[0, ndim)`` (``-1`` is the last).

    Raises ``ValueError`` (naming this rank) for an axis that is not an integer or out of range.
    """
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise ValueError(on_rank(rank, f"axis {axis!r} is out of range for a {ndim}-dimensional value"))
    return int(axis) % ndim


def is_array(x: Any) -> bool:
    """Arrays of any library (not distributed values): what ``merge_call`` wraps as ``PerReplica``.

    Objects with ``shape`` and ``dtype``, or with ``__dlpack__`` or ``__array__``.
    """
    if isinstance(x, DistributedValues):
        return False
    kind = type(x)
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or hasattr(kind, "__dlpack__") or hasattr(kind, "__array__")
