"""Distributed variables: mirrored (synchronized on write) and sync-on-read.

Each rank holds one component of a variable, an array of the strategy's array
module (NumPy, or CuPy on a GPU), updated in place so that views of it stay
valid. What updates, reads, saves and restores do is decided by one policy
object per synchronization mode (TF's ``OnWritePolicy`` / ``OnReadPolicy``):

- :class:`OnWritePolicy` (``MirroredVariable``): in replica context an
  update's argument is first reduced across replicas by the variable's
  aggregation, then the same update runs on every rank, so the components
  stay identical. In cross-replica context (and outside any scope) the argument
  is applied as given.
  A save stores the component once; a restore sets it on every rank.
- :class:`OnReadPolicy` (``SyncOnReadVariable``): replicas update their own
  component freely; a read outside replica context (in cross-replica context,
  or outside any strategy scope) reduces all components.
  A save stores that reduced value; a restore assigns it in cross-replica
  context (``SUM`` values split over the ranks present).

The surface other modules use (the strategy, ``strategy.extended``,
checkpoints): a variable's ``component`` (a plain attribute: the update path
reads it for every update), ``name``, ``aggregation``, ``strategy``,
:meth:`~DistributedVariable.coerce`, :meth:`~DistributedVariable.count_update`,
its ``policy`` (a :class:`Policy`) and ``prepared_updates`` (the strategy's
cache of the updates prepared for it, by update function). They never read a
variable's underscore attributes.

Which operations are collective is said in each docstring.
"""

from __future__ import annotations

import enum
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional, Union, cast

import numpy as np

from mpidist._comm.backend import contiguous, to_host
from mpidist._distribute.context import checked_replica_context, in_cross_replica_context, require_strategy
from mpidist._distribute.mirrors import fingerprint
from mpidist._errors import on_rank
from mpidist._values.values import ComponentOperators, DistributedValues, Mirrored, PerReplica, register_component

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

    from mpidist._distribute.strategy import MPIStrategy
    from mpidist._typing import Array

__all__ = [
    "MirroredVariable",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
]


class VariableAggregation(enum.Enum):
    """How replica-context updates (mirrored) or cross-replica reads (sync-on-read) combine replicas."""

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"

    __hash__ = object.__hash__  # members are singletons: identity hashing, at C speed (the per-update op lookup)


class VariableSynchronization(enum.Enum):
    """When a variable's components are brought in line: ``AUTO``/``ON_WRITE`` mirrored, ``ON_READ`` sync-on-read."""

    AUTO = "auto"
    ON_WRITE = "on_write"
    ON_READ = "on_read"


UPDATES: dict[str, Callable[[Any, Any], None]] = {
    "assign": lambda c, v: c.__setitem__(Ellipsis, v),
    "assign_add": lambda c, v: c.__iadd__(v),
    "assign_sub": lambda c, v: c.__isub__(v),
}


def _is_integer(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "iub"


def _split_exactly(total: Array, parts: int, index: int, xp: ModuleType) -> Array:
    """Share ``index`` of ``total`` split into ``parts`` integer shares that add up to ``total`` exactly."""
    quotient, remainder = xp.divmod(total, parts)
    return quotient + (remainder > index).astype(quotient.dtype)


def require_aggregation(var: DistributedVariable, what: str) -> None:
    """Local: raise ``ValueError`` unless ``var`` can combine replica-context updates (aggregation not ``NONE``).

    ``what`` names the update (``"assign_add"``, ``"strategy.batch_update"``).
    """
    if var.aggregation is VariableAggregation.NONE:
        raise ValueError(
            on_rank(
                var.strategy.rank,
                f"{what} of MirroredVariable {var.name!r} in replica context needs an aggregation to combine the "
                "replicas' values: create it with Variable(..., aggregation=VariableAggregation.SUM, MEAN or "
                "ONLY_FIRST_REPLICA), or update it in cross-replica context with strategy.update",
            )
        )


class Policy:
    """What updates, reads, saves and restores of a variable do; one instance per synchronization mode.

    The checkpoint asks a variable's policy what to save and how to restore
    it; it never looks at the variable's kind.
    """

    synchronization: VariableSynchronization

    def update(self, var: DistributedVariable, kind: str, value: ArrayLike) -> None:
        """Collective or local, as the variable classes say: ``kind`` (``"assign"``, ``"assign_add"``,
        ``"assign_sub"``) of ``value``."""
        raise NotImplementedError

    def read(self, var: DistributedVariable) -> Any:
        """Collective or local, as the variable classes say: the variable's value in the current context."""
        raise NotImplementedError

    def save_value(self, var: DistributedVariable, first_replica: bool) -> Array:
        """Collective: the array a checkpoint stores for ``var`` (rank 0's component with ``first_replica``)."""
        raise NotImplementedError

    def mirror_fingerprint(self, var: DistributedVariable, threads: int) -> Optional[int]:
        """Local: what must be the same on every rank before a save (``None``: components may differ)."""
        raise NotImplementedError

    def restore_target(self, var: DistributedVariable) -> Optional[Array]:
        """Local: the array a restore may overwrite with the saved value directly, or ``None``."""
        raise NotImplementedError

    def restore(self, var: DistributedVariable, value: ArrayLike) -> None:
        """Local: set ``var`` to a value its save stored (what a cross-replica ``assign`` does)."""
        raise NotImplementedError


class OnWritePolicy(Policy):
    """Mirrored variables: replica-context updates are reduced, then applied alike on every rank."""

    synchronization = VariableSynchronization.ON_WRITE

    def update(self, var: DistributedVariable, kind: str, value: ArrayLike) -> None:
        strategy = var._strategy  # the attributes, not the properties: the update is the hot path of training loops
        if checked_replica_context(strategy, kind, var._name) is None:  # cross-replica, or outside any scope
            UPDATES[kind](var.component, var.coerce(value))
            return
        if var._aggregation is VariableAggregation.NONE:
            require_aggregation(var, kind)
        # What merge_call would do, without wrapping and unwrapping the arguments
        strategy.extended.update_one(var, value, UPDATES[kind])

    def read(self, var: DistributedVariable) -> Any:
        return var.component

    def save_value(self, var: DistributedVariable, first_replica: bool) -> Array:
        """Local: the component. Collective with ``first_replica``: rank 0's component, broadcast to every rank
        (the variable is not changed)."""
        if not first_replica:
            return var.component
        strategy = var.strategy
        into = var.component if strategy.rank == 0 else strategy.backend.xp.empty_like(var.component)  # root: sent
        strategy.extended.broadcast_from_first(into, name=f"mirrored variable {var.name!r} (rank 0's value)")
        return into

    def mirror_fingerprint(self, var: DistributedVariable, threads: int) -> Optional[int]:
        return fingerprint(var.component, threads)

    def restore_target(self, var: DistributedVariable) -> Optional[Array]:
        return var.component

    def restore(self, var: DistributedVariable, value: ArrayLike) -> None:
        UPDATES["assign"](var.component, var.coerce(value))


class OnReadPolicy(Policy):
    """Sync-on-read variables: replicas update their own component; cross-replica reads reduce."""

    synchronization = VariableSynchronization.ON_READ

    def update(self, var: DistributedVariable, kind: str, value: ArrayLike) -> None:
        if checked_replica_context(var.strategy, kind, var.name) is not None:
            UPDATES[kind](var.component, var.coerce(value))
            return
        if kind != "assign":  # cross-replica context, or outside any scope
            raise RuntimeError(
                on_rank(
                    var.strategy.rank,
                    f"{kind} of SyncOnReadVariable {var.name!r} is only allowed in replica context (inside "
                    "strategy.run), where each replica updates its own component; in cross-replica context "
                    "(and outside any strategy scope) use assign(total), which splits the value over the replicas",
                )
            )
        cast("SyncOnReadVariable", var).lost_ranks = ()  # set afresh: what ranks that died held no longer counts
        self.restore(var, value)  # what a restore does: the total split over the replicas

    def read(self, var: DistributedVariable) -> Any:
        if checked_replica_context(var.strategy, "read_value()", var.name) is not None:
            return var.component
        # cross-replica context, or outside any scope: a collective, named for the deadline's messages
        cast("SyncOnReadVariable", var).warn_if_lost()
        return self._aggregate(var, f"read_value() of SyncOnReadVariable {var.name!r}")

    def save_value(self, var: DistributedVariable, first_replica: bool) -> Array:
        """Collective: the components reduced by the aggregation (``NONE``: summed, with a warning)."""
        cast("SyncOnReadVariable", var).warn_if_not_restorable()  # the policy of SyncOnReadVariable only
        cast("SyncOnReadVariable", var).warn_if_lost()
        return self._aggregate(var, var.name)

    def mirror_fingerprint(self, var: DistributedVariable, threads: int) -> Optional[int]:
        return None

    def restore_target(self, var: DistributedVariable) -> Optional[Array]:
        return None  # the value is split over the ranks

    def restore(self, var: DistributedVariable, value: ArrayLike) -> None:
        """Local: ``SUM`` values split over the replicas (exactly, for integers), other aggregations set as given."""
        array = var.coerce(value)
        strategy = var.strategy
        if var.aggregation is VariableAggregation.SUM:
            n, rank = strategy.num_replicas_in_sync, strategy.rank
            array = _split_exactly(array, n, rank, strategy.backend.xp) if _is_integer(var.dtype) else array / n
        var.component[...] = array

    @staticmethod
    def _aggregate(var: DistributedVariable, name: str) -> Any:
        return var.strategy.extended.aggregate(var.aggregation, var.component, name=name)


class DistributedVariable(DistributedValues):
    """A variable with one component per replica; this rank holds ``{rank: component}``.

    Not created directly: use :func:`Variable` inside ``strategy.scope()``.
    """

    # What updates, reads, saves and restores do (for the strategy and checkpoints): one per subclass.
    policy: Policy

    def __init__(self, strategy: MPIStrategy, component: Array, name: str, aggregation: VariableAggregation) -> None:
        super().__init__({strategy.rank: component})
        # This rank's component, updated in place. A plain attribute, not a property: every
        # update reads it (see the module docstring for the surface other modules use).
        self.component = component
        self._strategy = strategy
        self._name = name
        self._aggregation = aggregation
        self._updates = 0
        # per update function: the communicator's prepared update of this variable and the communicator's
        # generation it was made in (the strategy's update_one)
        self.prepared_updates: dict[Callable[[Any, Any], None], tuple[int, Optional[Callable[[Any, Any], None]]]] = {}
        register_component(self, strategy.rank, component)
        strategy.extended.track(self)

    # -- properties (local) -----------------------------------------------------------
    @property
    def name(self) -> str:
        """The variable's name (unique per strategy; default ``"Variable"``, ``"Variable_1"``, ...)."""
        return self._name

    @property
    def dtype(self) -> np.dtype:
        """The components' dtype."""
        return self.component.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The components' shape."""
        return tuple(self.component.shape)

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context updates (mirrored) or cross-replica reads (sync-on-read) combine replicas."""
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        """``ON_WRITE`` for a mirrored variable, ``ON_READ`` for a sync-on-read one."""
        return self.policy.synchronization

    @property
    def strategy(self) -> MPIStrategy:
        """The strategy whose scope created the variable."""
        return self._strategy

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self._name!r} shape={self.shape} dtype={self.dtype} "
            f"aggregation={self._aggregation.name} rank={self._strategy.rank}: {self.component!r}>"
        )

    __str__ = __repr__

    # -- reads and updates -------------------------------------------------------------
    def read_value(self) -> Any:
        """The variable's value. Collective for a sync-on-read variable outside replica context: in
        cross-replica context and outside any strategy scope it reduces every replica's component, so every
        rank must call it; local otherwise (see the class docstrings). ``numpy.asarray(v)`` is never collective.

        Where it is local, it returns this rank's component itself, not a copy: writing into it changes
        that component alone, without synchronising (a mirrored variable's replicas diverge). For a copy
        use :meth:`numpy` (host NumPy) or ``v.read_value().copy()``.
        """
        return self.policy.read(self)

    def numpy(self) -> np.ndarray:
        """A host NumPy copy of :meth:`read_value`: collective where ``read_value`` is."""
        return np.array(to_host(self.read_value()))

    def assign(
        self, value: ArrayLike, use_locking: bool = False, name: Optional[str] = None, read_value: bool = True
    ) -> Optional[DistributedVariable]:
        """Set the value; collective for a mirrored variable in replica context (see the class docstrings).

        Returns the variable, or ``None`` with ``read_value=False`` (as an
        eager TensorFlow variable does). ``use_locking`` and ``name`` are
        TensorFlow's arguments, accepted and without effect: a rank updates its
        component in place, and no graph op is named.
        """
        self.policy.update(self, "assign", value)
        return self if read_value else None

    def assign_add(
        self, value: ArrayLike, use_locking: bool = False, name: Optional[str] = None, read_value: bool = True
    ) -> Optional[DistributedVariable]:
        """Add to the value; collective for a mirrored variable in replica context. Arguments and result as
        :meth:`assign`'s."""
        self.policy.update(self, "assign_add", value)
        return self if read_value else None

    def assign_sub(
        self, value: ArrayLike, use_locking: bool = False, name: Optional[str] = None, read_value: bool = True
    ) -> Optional[DistributedVariable]:
        """Subtract from the value; collective for a mirrored variable in replica context. Arguments and result
        as :meth:`assign`'s."""
        self.policy.update(self, "assign_sub", value)
        return self if read_value else None

    def coerce(self, value: Any) -> Array:
        """Local: ``value`` as an array of the component's module, dtype and shape (broadcast), checked.

        ``ValueError`` for a shape that does not broadcast, ``TypeError`` for
        floating values into an integer variable.

        :meta private:
        """
        component = self.component
        if (
            type(value) is type(component)
            and value.dtype == component.dtype
            and value.shape == component.shape
            and value.flags.c_contiguous
        ):
            return value  # the common case, kept short
        if isinstance(value, DistributedValues):
            value = value.get(self._strategy.rank)
        array = self._strategy.backend.asarray(value, None, f"value for variable {self._name!r}", self._strategy.rank)
        try:
            fits = np.broadcast_shapes(tuple(array.shape), self.shape) == self.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                on_rank(
                    self._strategy.rank,
                    f"cannot update variable {self._name!r} of shape "
                    f"{self.shape} with a value of shape {tuple(array.shape)}",
                )
            )
        if _is_integer(self.dtype) and not _is_integer(array.dtype):
            raise TypeError(
                on_rank(
                    self._strategy.rank,
                    f"variable {self._name!r} has integer dtype {self.dtype}; "
                    f"updating it with {array.dtype} values would truncate them: cast explicitly",
                )
            )
        if array.dtype.kind == "c" and np.dtype(self.dtype).kind != "c":
            raise TypeError(
                on_rank(
                    self._strategy.rank,
                    f"variable {self._name!r} has real dtype {self.dtype}; updating it with {array.dtype} "
                    "values would discard their imaginary parts: cast explicitly",
                )
            )
        array = array.astype(self.dtype, copy=False)
        if tuple(array.shape) != self.shape:
            array = self._strategy.backend.xp.broadcast_to(array, self.shape)
        return contiguous(array)

    def count_update(self) -> int:
        """Local: count one replica-context update; returns how many there have been (for periodic mirror checks).

        :meta private:
        """
        self._updates += 1
        return self._updates


class MirroredVariable(DistributedVariable, Mirrored):
    """A variable kept identical on every replica.

    - Replica context: ``assign``, ``assign_add``, ``assign_sub`` are
      collective: every rank's argument is reduced by the variable's
      aggregation (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``: replica 0's),
      then the same update runs on every rank. Aggregation ``NONE`` raises
      ``ValueError``.
    - Cross-replica context, and outside any strategy scope: updates apply
      the argument as given on every rank (pass the same value everywhere).
      Local.
    - ``read_value()`` is the local component itself, not a copy. Local.
      Writing into it changes this rank's component without synchronising,
      and the replicas diverge; ``v.numpy()`` or ``v.read_value().copy()``
      is a copy.

    Python operators, attribute access and ``numpy.asarray`` act on the local
    component, as for :class:`~mpidist.Mirrored`.

    In replica context ``assign_add(c)`` with a plain constant ``c`` (the same
    on every rank) adds ``N * c`` under ``SUM`` aggregation: every replica's
    ``c`` is summed. Use ``MEAN`` or ``ONLY_FIRST_REPLICA`` for updates that
    every replica computes alike.
    """

    policy = OnWritePolicy()


class SyncOnReadVariable(DistributedVariable, PerReplica, ComponentOperators):
    """A variable each replica updates on its own; reads outside replica context reduce.

    - Replica context: ``assign``, ``assign_add``, ``assign_sub`` and
      ``read_value()`` touch only the local component. Local.
    - Cross-replica context, and outside any strategy scope (as in TensorFlow,
      where that is the default strategy's cross-replica context):
      ``read_value()``/``numpy()`` are collective, so every rank must call
      them, and return the ``SUM`` or ``MEAN`` of all components
      (``ONLY_FIRST_REPLICA``: replica 0's; ``NONE`` reads as ``SUM``).
      ``assign(x)`` is local and sets every component to ``x / N`` for
      ``SUM`` (integers: integer shares that add up to ``x`` exactly), so the
      value reads back as ``x``, and to ``x`` unchanged otherwise (``NONE``
      then reads back as ``N * x``); ``assign_add`` and ``assign_sub`` raise
      ``RuntimeError``.
    - Conversion (``numpy.asarray(v)``, the CUDA array interface, DLPack) is
      never collective: in replica context, or outside any strategy scope, it
      gives the local component; in cross-replica context it raises
      ``TypeError`` (use ``read_value()`` or ``strategy.read_var(v)``, which
      are collective). Python operators (``v + 1``, ``v[0]``, ``float(v)``)
      follow the same rule.
    """

    policy = OnReadPolicy()
    _warned_not_restorable = False  # set on the variable by the first warning
    # the ranks whose components were lost since the value was last set whole (a cross-replica assign, a metric's
    # reset_state), numbered as the strategy's ranks were when it was created: set by strategy.recover(); a read
    # then warns, once
    lost_ranks: tuple[int, ...] = ()
    _warned_lost: tuple[int, ...] = ()

    def warn_if_lost(self) -> None:
        """Local: warn (once per loss) that ranks which died held part of this value since it was last set whole."""
        if self.lost_ranks and self._warned_lost != self.lost_ranks:
            self._warned_lost = self.lost_ranks
            many = len(self.lost_ranks) > 1
            warnings.warn(
                on_rank(
                    self.strategy.rank,
                    f"SyncOnReadVariable {self.name!r} lacks the part{'s' if many else ''} of rank"
                    f"{'s' if many else ''} {', '.join(map(str, self.lost_ranks))}, which died (numbered as when the "
                    "strategy was created): its value counts only what the survivors held. Assign it (a metric: "
                    "reset_state()) to count afresh.",
                ),
                RuntimeWarning,
                stacklevel=4,
            )

    def _convertible(self) -> Any:
        if in_cross_replica_context():
            raise TypeError(
                on_rank(
                    self._strategy.rank,
                    f"cannot convert SyncOnReadVariable {self._name!r} to an array in "
                    "cross-replica context: its value there is the reduction of all replicas' components, which "
                    "needs every rank. Call v.read_value() or strategy.read_var(v) (collective) on every rank, or "
                    "convert inside strategy.run for this replica's component",
                )
            )
        return self.component

    def warn_if_not_restorable(self) -> None:
        """Local: warn once that a saved ``NONE`` variable does not restore to the value it had.

        Saving stores the ``SUM`` of the components; restoring assigns that
        value unchanged to every component, so it then reads back ``N`` times
        larger.
        """
        if self._aggregation is VariableAggregation.NONE and not self._warned_not_restorable:
            self._warned_not_restorable = True
            warnings.warn(
                on_rank(
                    self._strategy.rank,
                    f"SyncOnReadVariable {self._name!r} has aggregation NONE: it is saved "
                    "as the SUM of its components but restored by assigning that sum to every component, so it does "
                    "not round-trip; give it aggregation SUM, MEAN or ONLY_FIRST_REPLICA",
                ),
                UserWarning,
                stacklevel=4,
            )


def Variable(
    initial_value: Union[ArrayLike, Callable[[], ArrayLike]],
    name: Optional[str] = None,
    dtype: Optional[DTypeLike] = None,
    synchronization: Optional[VariableSynchronization] = VariableSynchronization.AUTO,
    aggregation: Optional[VariableAggregation] = VariableAggregation.NONE,
) -> DistributedVariable:
    """Create a distributed variable of the strategy whose ``scope()`` is active.

    Collective: every rank creates its variables in the same order. The
    initial value (an array, a number, or a callable returning one) is rank
    0's, broadcast, so replicas start identical even from random values.
    ``synchronization`` and ``aggregation`` take the enums or their names;
    ``None`` means ``AUTO`` and ``NONE``, as in TensorFlow.

    Returns:
        a :class:`MirroredVariable` (``AUTO``, ``ON_WRITE``) or a
        :class:`SyncOnReadVariable` (``ON_READ``).

    Raises:
        RuntimeError: outside ``strategy.scope()``.
        ValueError: ``MEAN`` aggregation on an integer variable; shapes or
            dtypes that differ between ranks (``CollectiveMismatchError``).
    """
    strategy = require_strategy("Variable(...)")
    synchronization = (
        VariableSynchronization.AUTO if synchronization is None else VariableSynchronization(synchronization)
    )
    aggregation = VariableAggregation.NONE if aggregation is None else VariableAggregation(aggregation)
    if callable(initial_value):
        initial_value = initial_value()
    try:
        component = strategy.backend.array(initial_value, dtype, "initial value", strategy.rank)  # always a copy
    except Exception as exc:  # a value that cannot be converted: every rank raises, in the initial broadcast
        strategy.extended.communicator.fail(exc, "Variable(...)")
    if name is None:
        name = strategy.extended.default_name()
    if aggregation is VariableAggregation.MEAN and _is_integer(component.dtype):
        raise ValueError(
            on_rank(
                strategy.rank,
                f"variable {name!r} has integer dtype {component.dtype}: MEAN "
                "aggregation would truncate; use a floating dtype or SUM aggregation",
            )
        )
    strategy.extended.broadcast_from_first(component, name=name)
    if synchronization is VariableSynchronization.ON_READ:
        return SyncOnReadVariable(strategy, component, name, aggregation)
    component = strategy.extended.place(component)
    return MirroredVariable(strategy, component, name, aggregation)
