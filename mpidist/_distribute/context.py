"""Replica and cross-replica contexts.

*Cross-replica context* is code inside ``with strategy.scope():`` but outside
``strategy.run``, and the body of ``merge_call``: there, operations that need
other ranks' data are collective calls that every rank makes in the same
order. *Replica context* is code inside ``strategy.run(fn)``: ``fn`` sees
this rank's components as plain arrays.

The context stack is per thread; a scope may be entered again and nested
in itself, never inside another strategy's scope (except a process set's, in
the scope of the strategy it was split from). Nothing here communicates by
itself; :meth:`ReplicaContext.merge_call`, :meth:`ReplicaContext.all_reduce`
and :meth:`ReplicaContext.all_gather` are collective because what they run is.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from mpidist._comm.reduce_op import ReduceOp
from mpidist._errors import on_rank
from mpidist._values import values

if TYPE_CHECKING:  # imported for type hints only: the strategy layer sits above this one
    from mpidist._distribute.strategy import MPIStrategy
    from mpidist._distribute.variables import VariableAggregation

__all__ = ["ReplicaContext", "get_replica_context", "get_strategy", "in_cross_replica_context"]


class _Frame:
    __slots__ = ("strategy", "replica")

    def __init__(self, strategy: MPIStrategy, replica: Optional[ReplicaContext]) -> None:
        self.strategy = strategy
        self.replica = replica


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []


_stack = _Stack()


def _top() -> Optional[_Frame]:
    return _stack.frames[-1] if _stack.frames else None


def _mixing_error(strategy: MPIStrategy, active: MPIStrategy, what: str) -> RuntimeError:
    """The error of ``what`` (a method of ``strategy``) called inside the scope of another strategy, ``active``."""
    return RuntimeError(
        on_rank(
            strategy.rank,
            f"{what} (of {strategy!r}) was called inside the scope of another strategy, {active!r}; "
            "strategies do not mix (one strategy at a time per thread): leave the other strategy's scope first",
        )
    )


class enter_context:
    """Context manager: push a cross-replica (``replica=None``) or replica frame for ``strategy``. Local.

    The object may be entered again, also while it is active (each entry
    pushes a frame, each exit pops one): what ``strategy.scope()`` returns.
    Entering it inside the scope of another strategy raises ``RuntimeError``
    naming both, unless that strategy is one of ``within`` (those a process
    set was split from). A class rather than a generator: it runs on every
    ``strategy.run``.
    """

    __slots__ = ("_frame", "_what", "_within")

    def __init__(
        self,
        strategy: MPIStrategy,
        replica: Optional[ReplicaContext] = None,
        what: str = "scope()",
        within: tuple[MPIStrategy, ...] = (),
    ) -> None:
        self._frame = _Frame(strategy, replica)
        self._what = what
        self._within = within

    def __enter__(self) -> MPIStrategy:
        strategy = self._frame.strategy
        top = _top()
        if top is not None and top.strategy is not strategy and not any(top.strategy is s for s in self._within):
            raise _mixing_error(strategy, top.strategy, self._what)
        _stack.frames.append(self._frame)
        return strategy

    def __exit__(self, *exc: object) -> None:
        _stack.frames.pop()


def checked_replica_context(
    strategy: MPIStrategy, what: str, variable: Optional[str] = None
) -> Optional[ReplicaContext]:
    """Local: the current replica context (``None`` in cross-replica context and outside any scope).

    Raises ``RuntimeError`` naming both strategies when the active scope (or
    ``run``) is another strategy's: ``what`` (a method of ``strategy``, or
    of its variable named ``variable``) must not run there, as in TensorFlow.
    """
    frames = _stack.frames  # _top(), spelled out: every variable update asks
    if not frames:
        return None
    top = frames[-1]
    if top.strategy is not strategy:
        raise _mixing_error(strategy, top.strategy, what if variable is None else f"{what} of variable {variable!r}")
    return top.replica


def checked_collective_context(strategy: MPIStrategy, what: str) -> Optional[ReplicaContext]:
    """:func:`checked_replica_context` for ``what``, a method that is collective on every rank.

    Local, and collective only when it fails: a rank inside another strategy's scope takes part
    in the collective the other ranks make, with its ``RuntimeError`` (``Communicator.fail``),
    so that they raise :class:`~mpidist.CollectiveMismatchError` naming it at once instead of
    waiting for it until the deadline.
    """
    try:
        return checked_replica_context(strategy, what)
    except RuntimeError as error:  # the strategies-do-not-mix error, the only one it raises
        strategy.communicator.fail(error, what)


def get_strategy() -> Optional[MPIStrategy]:
    """The strategy whose ``scope()`` (or ``run``) is active in this thread, else ``None``. Local."""
    top = _top()
    return top.strategy if top else None


def get_replica_context() -> Optional[ReplicaContext]:
    """The current :class:`ReplicaContext` inside ``strategy.run``; ``None`` elsewhere. Local."""
    top = _top()
    return top.replica if top else None


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` outside ``run``, and inside ``merge_call``. Local."""
    top = _top()
    return top is not None and top.replica is None


def _replica_id() -> Optional[int]:
    """The current replica's id in replica context, else ``None``: what ``DistributedValues.get()`` uses."""
    top = _top()
    return top.replica.replica_id_in_sync_group if top is not None and top.replica is not None else None


values.set_replica_id_source(_replica_id)


def require_strategy(what: str) -> MPIStrategy:
    """The active strategy, or a ``RuntimeError`` saying where ``what`` must be called."""
    strategy = get_strategy()
    if strategy is None:
        raise RuntimeError(f"{what} needs a strategy: call it inside `with strategy.scope():` (or inside strategy.run)")
    return strategy


def call_arguments(what: str, rank: int, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """Local: ``args`` (a tuple or list) and ``kwargs`` (a mapping or ``None``) for a call of ``fn``.

    Anything else raises ``TypeError`` naming ``what`` and the type passed:
    ``args=x`` for ``args=(x,)`` would otherwise unpack an array's rows or
    a string's characters into the call.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            on_rank(
                rank,
                f"{what}: args must be a tuple or list of positional arguments, got "
                f"{type(args).__name__}; pass one argument as args=(x,)",
            )
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            on_rank(rank, f"{what}: kwargs must be a dict of keyword arguments or None, got {type(kwargs).__name__}")
        )
    return tuple(args), dict(kwargs or {})


class ReplicaContext:
    """What ``fn`` sees inside ``strategy.run(fn)``: this rank as one replica.

    Attributes:
        strategy: the strategy running ``fn``.
        replica_id_in_sync_group: this replica's id (the rank in the strategy's communicator).
    """

    def __init__(self, strategy: MPIStrategy, replica_id: int) -> None:
        self.strategy = strategy
        self.replica_id_in_sync_group = replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas (the strategy's communicator size)."""
        return self.strategy.num_replicas_in_sync

    def __repr__(self) -> str:
        return f"<ReplicaContext replica {self.replica_id_in_sync_group} of {self.num_replicas_in_sync}>"

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Collective: run ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context.

        Every rank must call it (``merge_fn`` usually runs collectives). Array
        arguments arrive in ``merge_fn`` wrapped as ``PerReplica`` values,
        so cross-replica code can ``strategy.reduce`` them. The result comes
        back to the replica with distributed values (other than variables)
        replaced by this replica's component.
        """
        return self.strategy.extended.merge_call(merge_fn, args, kwargs)

    def all_reduce(
        self,
        reduce_op: Union[ReduceOp, VariableAggregation, str],
        value: Any,
        *,
        out: Any = None,
        compression: Optional[str] = None,
    ) -> Any:
        """Collective: reduce a nest of arrays across replicas; every replica gets the result.

        ``reduce_op`` is a ``ReduceOp``, a ``VariableAggregation`` or a name
        of either, as for ``strategy.reduce``. All arrays of the nest are
        reduced together; the result has the nest's structure with plain
        arrays, identical on every rank. A distributed value contributes
        this rank's component. ``out`` (a nest of arrays like ``value``)
        receives the result without allocating, and ``compression`` sends
        float32 values over the wire in 16 bits, as in ``strategy.reduce``.
        """
        return self.strategy.extended.reduce(reduce_op, value, out=out, compression=compression)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Collective: every replica's ``value`` (a nest of arrays) concatenated along ``axis``, in replica order.

        What ``strategy.gather`` does, from replica context: each leaf of the
        nest is gathered on its own; leaves may differ in length along
        ``axis`` between replicas (the other dimensions must agree); a 0-d
        leaf gives one element per replica. Every replica gets the whole
        result, a nest of plain arrays of the nest's structure.
        """
        return self.strategy.extended.gather(value, axis)
