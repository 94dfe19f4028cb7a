"""Multi-step loops: several steps per call, their outputs recorded in a :class:`MultiStepContext`.

:func:`run_steps_on_dataset` runs a step function for up to ``iterations``
steps of an iterator and returns the context the steps recorded their
outputs in. What a step needs of the strategy (running it in replica
context, reducing its outputs, checking a reduce op) is passed in by
:meth:`~mpidist.MPIStrategy.run_steps_on_dataset`, so that this module knows
nothing of the strategy. To fetch the batches of all the steps in one
transfer, distribute the dataset with ``steps_per_transfer=iterations``:
a chunk is then the steps of one call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from mpidist._input.distributed import DistributedDataset
from mpidist._input.prefetch import wrap
from mpidist._input.sharding import check_count
from mpidist._values.values import select_replica

__all__ = ["MultiStepContext", "run_steps_on_dataset"]

RunFn = Callable[..., Any]  # strategy.run: fn(*args) in replica context, the result wrapped as PerReplica
ReduceFn = Callable[[Any, Any], Any]  # strategy.reduce: (reduce op, value) -> value reduced across replicas


class MultiStepContext:
    """Outputs of the steps run by one :meth:`~mpidist.MPIStrategy.run_steps_on_dataset` call.

    The step function records outputs with :meth:`set_last_step_output` and
    :meth:`set_non_tensor_output` (replica context, local); they are
    available once the call has returned.

    Args:
        rank: this replica.
        check_reduce_op: raises on a reduce op that ``strategy.reduce`` refuses.

    Attributes:
        last_step_outputs: ``name`` -> the value last recorded under ``name``,
            reduced across replicas with its ``reduce_op`` (a plain array,
            identical on every rank) or, without one, a nest of ``PerReplica``.
        non_tensor_outputs: ``name`` -> what was recorded, as it is (this rank's).
        steps_run: the steps run: fewer than ``iterations`` when the data ran
            out, the same number on every rank.
    """

    def __init__(self, rank: int, check_reduce_op: Callable[[Any], object]) -> None:
        self._rank, self._check_reduce_op = rank, check_reduce_op
        self._outputs: dict[str, tuple[Any, Any]] = {}
        self.last_step_outputs: dict[str, Any] = {}
        self.non_tensor_outputs: dict[str, Any] = {}
        self.steps_run = 0

    def set_last_step_output(self, name: str, output: Any, reduce_op: Any = None) -> None:
        """Record ``output`` (a nest of arrays or numbers) under ``name``. Local.

        ``reduce_op`` is what ``strategy.reduce`` accepts (a ``ReduceOp``, a
        ``VariableAggregation`` or a name of either), checked here. Every
        rank must record the same names: they are reduced together after the
        last step.
        """
        if reduce_op is not None:
            self._check_reduce_op(reduce_op)
        local = select_replica(None, output)
        self._outputs[name] = (local, reduce_op)

    def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Record any object under ``name`` in ``non_tensor_outputs``, unreduced. Local."""
        self.non_tensor_outputs[name] = output

    def _collect(self, reduce: ReduceFn) -> None:
        """Collective when any output has a reduce op: reduce the outputs in name order."""
        for name in sorted(self._outputs):
            value, op = self._outputs[name]
            self.last_step_outputs[name] = wrap(self._rank, value) if op is None else reduce(op, value)

    def __repr__(self) -> str:
        return (
            f"<MultiStepContext steps_run={self.steps_run} last_step_outputs={sorted(self._outputs)} "
            f"non_tensor_outputs={sorted(self.non_tensor_outputs)}>"
        )


def run_steps_on_dataset(
    fn: Callable[[MultiStepContext, Any], Any],
    iterator: Iterator[Any],
    iterations: int,
    *,
    rank: int,
    run: RunFn,
    reduce: ReduceFn,
    check_reduce_op: Callable[[Any], object],
) -> MultiStepContext:
    """Run ``run(fn, args=(ctx, inputs))`` for up to ``iterations`` steps; returns the context ``ctx``.

    ``inputs`` is the next element of ``iterator``; ``run`` (the strategy's)
    calls ``fn`` in replica context with ``PerReplica`` values unwrapped.
    Stops early, on every rank alike, when the iterator is exhausted; then
    the outputs recorded with a reduce op are reduced with ``reduce``.
    Collective: as collective as ``fn`` and ``next(iterator)``, plus one
    reduction per output recorded with a ``reduce_op``.
    """
    iterations = check_count("iterations", iterations, 1)
    if isinstance(iterator, DistributedDataset) or not hasattr(iterator, "__next__"):
        raise TypeError(
            f"run_steps_on_dataset needs an iterator, got {type(iterator).__name__}; pass "
            "iter(distributed_dataset) and reuse it across calls"
        )
    ctx = MultiStepContext(rank, check_reduce_op)
    for _ in range(iterations):
        try:
            inputs = next(iterator)
        except StopIteration:
            break
        run(fn, args=(ctx, inputs))
        ctx.steps_run += 1
    ctx._collect(reduce)
    return ctx
