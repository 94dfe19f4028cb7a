"""Behaviours TensorFlow 2's own strategy tests check, under mpiexec at 1, 2 and 3 ranks.

One test (or group) per behaviour, in TensorFlow 2's words where they exist:
the cross-replica read of a sync-on-read variable outside any scope, local
results of a returned nest, ``ReplicaContext.all_gather``, operators on a
sync-on-read variable in replica context, mirrored assignment outside any
scope, re-entrant scopes, strategies that do not mix, ``aggregation=None`` and
the ``assign*`` signature. Expected values are derived from rank and size;
every rank makes the same collective calls in the same order.
"""

from __future__ import annotations

import collections
import re
import time

import numpy as np
import pytest

import mpidist as md
from arrays import DEVICES, assert_close, assert_equal, host
from mpidist import (
    CollectiveMismatchError,
    MPIStrategy,
    PerReplica,
    Variable,
    VariableAggregation as Agg,
    VariableSynchronization as Sync,
)

pytestmark = pytest.mark.mpi

Pair = collections.namedtuple("Pair", "a b")


@pytest.fixture(scope="module", params=DEVICES)
def strategy(request):
    s = MPIStrategy(device=request.param)
    yield s
    s.free()


def converted(strategy, v):
    """``numpy.asarray(v)`` on the host, ``cupy.asarray(v)`` on a GPU (never an implicit device-to-host copy)."""
    return host(strategy.backend.xp.asarray(v))


def on_read(strategy, aggregation, initial=0.0, name=None):
    """Collective: a sync-on-read variable whose component on rank r is ``r + 1``."""
    with strategy.scope():
        v = Variable(initial, name=name, synchronization="on_read", aggregation=aggregation)
    strategy.run(lambda: v.assign(float(strategy.rank + 1)))
    return v


# -- 1. the cross-replica read outside any scope ------------------------------------------------
@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("sum", lambda n: n * (n + 1) / 2),
        ("mean", lambda n: (n + 1) / 2),
        ("only_first_replica", lambda n: 1.0),
        ("none", lambda n: n * (n + 1) / 2),  # NONE reads as SUM
    ],
)
def test_sync_on_read_outside_any_scope_reads_across_replicas(strategy, aggregation, expected):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    v = on_read(strategy, aggregation)
    assert md.get_strategy() is None
    for _ in range(2):  # twice: nothing is cached
        assert_close(v.read_value(), expected(n))  # collective, on every rank
        assert isinstance(v.numpy(), np.ndarray) and float(v.numpy()) == pytest.approx(expected(n))
        assert float(host(strategy.read_var(v))) == pytest.approx(expected(n))
        with strategy.scope():  # the same read as in cross-replica context
            assert float(host(v.read_value())) == pytest.approx(expected(n))
    # conversion stays local and never communicates, so one rank alone may do it
    if r == 0:
        assert float(converted(strategy, v)) == 1.0
    assert float(converted(strategy, v)) == r + 1
    assert float(host(strategy.run(lambda: v.read_value()).get())) == r + 1  # replica context: local


def test_sync_on_read_assign_outside_any_scope_splits_as_in_cross_replica_context(strategy):
    n = strategy.num_replicas_in_sync
    v = on_read(strategy, "sum")
    v.assign(6.0)
    assert float(converted(strategy, v)) == pytest.approx(6.0 / n)
    assert float(v.numpy()) == pytest.approx(6.0)
    with pytest.raises(RuntimeError, match=r"assign_add of SyncOnReadVariable .*only allowed in replica context"):
        v.assign_add(1.0)
    assert float(v.numpy()) == pytest.approx(6.0)


def test_a_read_on_one_rank_only_fails_naming_read_value():
    """``if rank == 0: v.numpy()`` is a collective on one rank: the ranks' calls disagree, named."""
    s = MPIStrategy()
    n, r = s.num_replicas_in_sync, s.rank
    v = on_read(s, "sum", name="seen")
    if n == 1:
        assert float(v.numpy()) == 1.0
    else:
        with pytest.raises(CollectiveMismatchError) as info:
            if r == 0:
                v.numpy()  # rank 0 reads ...
            else:
                s.barrier()  # ... while the others go on to their next collective
        message = str(info.value)
        assert message.startswith(f"rank {r}: ")
        assert "read_value() of SyncOnReadVariable 'seen'" in message and "barrier" in message
    assert float(v.numpy()) == pytest.approx(n * (n + 1) / 2)  # nothing was modified; all ranks read again
    s.free()


# -- 2. experimental_local_results of a nest -------------------------------------------------------
def test_local_results_of_a_returned_nest_are_plain_nests(strategy):
    r = strategy.rank
    out = strategy.run(lambda: {"a": 1.0, "b": 2.0})
    assert isinstance(out["a"], PerReplica)
    assert strategy.experimental_local_results(out) == ({"a": 1.0, "b": 2.0},)
    nested = strategy.run(lambda: [Pair(a=np.full(2, float(r)), b="label"), (r, {"k": r * 10})])
    (local,) = strategy.experimental_local_results(nested)
    assert isinstance(local, list) and isinstance(local[0], Pair) and local[0].b == "label"
    assert_equal(local[0].a, np.full(2, float(r)))
    assert local[1] == (r, {"k": r * 10})
    assert strategy.experimental_local_results(PerReplica({r: 5})) == (5,)
    plain = {"x": 1}
    assert strategy.experimental_local_results(plain)[0] is plain


def test_local_results_of_a_nest_with_several_replicas_components(strategy):
    n = strategy.num_replicas_in_sync
    nest = {"v": PerReplica({q: q * 2 for q in range(n)}), "c": "same"}
    assert strategy.experimental_local_results(nest) == tuple({"v": q * 2, "c": "same"} for q in range(n))


# -- 3. ReplicaContext.all_gather ----------------------------------------------------------------
def test_all_gather_of_a_nest_with_unequal_lengths(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    xp = strategy.backend.xp
    rows = np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)])
    ints = np.concatenate([np.arange(q + 1) for q in range(n)])
    cols = np.concatenate([np.full((2, q + 1), q) for q in range(n)], axis=1)

    def fn():
        ctx = md.get_replica_context()
        value = {"rows": xp.full((r + 1, 2), float(r)), "more": [xp.arange(r + 1), xp.asarray(r * 1.5)]}
        return ctx.all_gather(value, axis=0), ctx.all_gather(
            Pair(a=xp.full((2, r + 1), r), b=xp.ones((1, r + 1))), axis=-1
        )

    for _ in range(2):  # twice: lazy set-up
        out = strategy.run(fn)
        ((gathered, along_last),) = strategy.experimental_local_results(out)
        assert_equal(gathered["rows"], rows)
        assert_equal(gathered["more"][0], ints)
        assert_equal(gathered["more"][1], np.arange(n) * 1.5)  # 0-d: one element per replica
        assert isinstance(along_last, Pair)
        assert_equal(along_last.a, cols)
        assert_equal(along_last.b, np.ones((1, n * (n + 1) // 2)))
        assert type(gathered["rows"]) is xp.ndarray


def test_strategy_gather_takes_nests_too(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    out = strategy.gather({"x": PerReplica({r: np.full(r + 1, r)}), "y": (np.ones((1, 2)) * r,)})
    assert_equal(out["x"], np.concatenate([np.full(q + 1, q) for q in range(n)]))
    assert_equal(out["y"][0], np.arange(n)[:, None] * np.ones((1, 2)))


def test_all_gather_with_a_bad_axis_on_one_rank_raises_on_every_rank(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    if n == 1:
        pytest.skip("needs a second rank")
    axis = 5 if r == n - 1 else 0

    def fn():
        return md.get_replica_context().all_gather([np.zeros((2, 2))], axis=axis)

    expected = (ValueError, "axis 5 is out of range") if r == n - 1 else (CollectiveMismatchError, f"rank {n - 1}")
    with pytest.raises(expected[0], match=expected[1]):
        strategy.run(fn)
    assert_equal(strategy.run(lambda: md.get_replica_context().all_gather(np.ones(1))).get(), np.ones(n))


# -- 4. operators on a sync-on-read variable ----------------------------------------------------
def test_operators_on_sync_on_read_use_the_local_component_in_replica_context(strategy):
    r = strategy.rank
    with strategy.scope():
        v = Variable(np.zeros(3), synchronization=Sync.ON_READ, aggregation=Agg.SUM)
        w = Variable(2.0, synchronization=Sync.ON_READ, aggregation=Agg.MEAN)
    xp = strategy.backend.xp
    local = xp.arange(3.0) + r

    def fn():
        v.assign(local)
        return (v + 1, 1 + v, v * 2, v - w, -v, abs(-v), v[1], v == local, xp.ones(3) + v, w**2, 2**w, float(w))

    results = strategy.experimental_local_results(strategy.run(fn))[0]
    expected = (local + 1, 1 + local, local * 2, local - 2, -local, local, local[1], np.full(3, True))
    for got, want in zip(results, expected + (xp.ones(3) + local, 4.0, 4.0, 2.0)):
        assert_equal(got, want)
    assert type(results[0]) is strategy.backend.xp.ndarray
    assert_equal(v + 1, local + 1)  # outside any scope: the local component, as conversion
    with strategy.scope(), pytest.raises(TypeError, match=rf"rank {r}: .*read_value\(\)"):
        v + 1  # cross-replica context: the value is a reduction, which an operator never runs


# -- 5. mirrored assignment outside any scope -----------------------------------------------------
def test_mirrored_assign_outside_any_scope_applies_as_in_cross_replica_context(strategy):
    with strategy.scope():
        v = Variable(np.zeros(2), aggregation="mean")
    assert md.get_strategy() is None
    assert v.assign(np.array([3.0, 4.0])) is v
    v.assign_add(1.0)
    v.assign_sub(np.array([0.5, 0.5]))
    assert_equal(v.numpy(), [3.5, 4.5])
    strategy.check_mirrored([v])  # collective: identical everywhere
    strategy.run(lambda: v.assign_add(float(strategy.rank)))  # replica context: still the mean of the arguments
    assert_close(v.numpy(), np.array([3.5, 4.5]) + (strategy.num_replicas_in_sync - 1) / 2)


# -- 6. re-entrant scopes ------------------------------------------------------------------------
def test_a_scope_can_be_entered_again_and_nested(strategy):
    a = strategy.scope()
    with a as s:
        assert s is strategy and md.get_strategy() is strategy and md.in_cross_replica_context()
        with a:
            b = strategy.scope()
            with b, a:
                assert md.in_cross_replica_context()
                v = Variable(1.0, name="nested_scope")
            assert md.get_strategy() is strategy
        assert md.in_cross_replica_context()
        assert_equal(strategy.run(lambda: md.get_replica_context().replica_id_in_sync_group).get(), strategy.rank)
    assert md.get_strategy() is None and not md.in_cross_replica_context()
    with a:  # used again after leaving it
        assert md.get_strategy() is strategy
        assert_equal(strategy.reduce("sum", v), strategy.num_replicas_in_sync)
    assert md.get_strategy() is None


# -- 7. strategies do not mix ----------------------------------------------------------------------
def test_another_strategys_methods_inside_a_scope_raise_naming_both(strategy):
    other = MPIStrategy()
    r = strategy.rank
    with other.scope():
        theirs = Variable(np.zeros(2), name="theirs", aggregation="sum")
        counted = Variable(0.0, name="counted", synchronization="on_read", aggregation="sum")
    calls = {
        "strategy.reduce": lambda: other.reduce("sum", 1.0),
        "strategy.reduce_async": lambda: other.reduce_async("sum", np.ones(1)),
        "strategy.gather": lambda: other.gather(np.ones(1)),
        "strategy.broadcast": lambda: other.broadcast(np.ones(1)),
        "strategy.barrier": other.barrier,
        "strategy.distribute_dataset": lambda: other.distribute_dataset(range(4)),
        "strategy.distribute_datasets_from_function": lambda: other.distribute_datasets_from_function(
            lambda ctx: range(4)
        ),
        "strategy.run_steps_on_dataset": lambda: other.run_steps_on_dataset(lambda c, x: None, iter([]), 1),
        "strategy.run": lambda: other.run(lambda: None),
        "scope()": lambda: other.scope().__enter__(),
        "strategy.update": lambda: other.update(theirs, lambda c: None),
        "strategy.read_var": lambda: other.read_var(counted),
        "strategy.check_mirrored": lambda: other.check_mirrored([theirs]),
        "strategy.batch_update": lambda: other.batch_update([(theirs, np.ones(2))]),
        "assign_add of variable 'theirs'": lambda: theirs.assign_add(np.ones(2)),
        "read_value() of variable 'counted'": counted.read_value,
    }
    mine, yours = re.escape(repr(strategy)), re.escape(repr(other))
    assert mine != yours
    for where in ("scope", "run"):
        for what, call in calls.items():
            pattern = rf"^rank {r}: {re.escape(what)} \(of {yours}\) .*another strategy, {mine}"
            if where == "scope":
                with strategy.scope(), pytest.raises(RuntimeError, match=pattern):
                    call()
            else:

                def inside(call=call, pattern=pattern):
                    with pytest.raises(RuntimeError, match=pattern):
                        call()

                strategy.run(inside)
        assert md.get_strategy() is None
    # nothing ran: the other strategy's collectives still pair off, outside any scope
    assert_equal(other.reduce("sum", 1.0), strategy.num_replicas_in_sync)
    assert_equal(theirs.numpy(), np.zeros(2))
    other.free()


@pytest.mark.parametrize("method", ["reduce", "gather", "broadcast", "barrier", "check_mirrored"])
def test_a_rank_that_mixes_strategies_alone_raises_on_every_rank_at_once(strategy, method):
    """One rank calls the other strategy's collective method inside this strategy's scope, the others outside any:
    that rank raises its RuntimeError and every other rank a CollectiveMismatchError naming it, in the same call
    (not a wait until the deadline); afterwards the other strategy's collectives pair off as before."""
    n, r = strategy.num_replicas_in_sync, strategy.rank
    if n == 1:
        pytest.skip("needs a rank that does not mix")
    other = MPIStrategy(timeout=600)
    with other.scope():
        theirs = Variable(np.zeros(2), name="theirs")
    call = {
        "reduce": lambda: other.reduce("sum", 1.0),
        "gather": lambda: other.gather(np.ones(1)),
        "broadcast": lambda: other.broadcast(np.ones(1)),
        "barrier": other.barrier,
        "check_mirrored": lambda: other.check_mirrored([theirs]),
    }[method]
    began = time.monotonic()
    if r == n - 1:
        with strategy.scope(), pytest.raises(RuntimeError, match=rf"^rank {r}: strategy.{method} .*do not mix"):
            call()
    else:
        with pytest.raises(CollectiveMismatchError, match=rf"rank {n - 1}: .*strategy.{method} .*do not mix"):
            call()
    assert time.monotonic() - began < 10  # at once, not at the 600 s deadline
    assert_equal(other.reduce("sum", 1.0), n)
    other.free()


# -- 8. aggregation=None ------------------------------------------------------------------------
def test_aggregation_none_and_synchronization_none_are_the_defaults(strategy):
    with strategy.scope():
        v = Variable(1.0, aggregation=None)
        w = Variable(1.0, synchronization=None, aggregation=None)
        s = Variable(1.0, synchronization="on_read", aggregation=None)
    assert v.aggregation is Agg.NONE and w.synchronization is Sync.ON_WRITE and isinstance(w, md.MirroredVariable)
    assert s.aggregation is Agg.NONE and isinstance(s, md.SyncOnReadVariable)
    with pytest.raises(ValueError, match="needs an aggregation"):
        strategy.run(lambda: v.assign(2.0))  # NONE cannot combine replica-context updates, as before
    assert float(s.numpy()) == strategy.num_replicas_in_sync  # NONE reads as SUM


# -- 9. the assign* signature --------------------------------------------------------------------
@pytest.mark.parametrize("synchronization", ["on_write", "on_read"])
def test_assign_takes_tensorflows_signature(strategy, synchronization):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = Variable(np.zeros(2), synchronization=synchronization, aggregation="sum")

    def fn():
        a = v.assign(np.ones(2), use_locking=True, name="set", read_value=False)
        b = v.assign_add(np.ones(2), False, "add")
        c = v.assign_sub(np.ones(2), read_value=False)
        return a is None, b is v, c is None

    (results,) = strategy.experimental_local_results(strategy.run(fn))
    assert results == (True, True, True)
    # mirrored: each update adds the n replicas' arguments (n, 2n, n); sync-on-read: each rank's 1, summed
    assert_close(v.numpy(), np.full(2, float(n)))
    assert v.assign(np.full(2, 4.0), read_value=False) is None  # outside any scope too
    assert v.assign(np.full(2, 5.0), use_locking=False, name=None, read_value=True) is v
    assert_close(v.numpy(), np.full(2, 5.0))
