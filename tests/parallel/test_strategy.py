"""MPIStrategy and contexts (api-contract C1, C2) under mpiexec at 1, 2 and 3 ranks.

Expected values are derived from rank and size; every rank makes the same
collective calls in the same order.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import DEVICES, assert_close, assert_equal
from mpidist import Mirrored, MPIStrategy, PerReplica, ReduceOp

pytestmark = pytest.mark.mpi

Pair = collections.namedtuple("Pair", "a b")


@pytest.fixture(scope="module", params=DEVICES)
def strategy(request):
    s = MPIStrategy(device=request.param)
    yield s
    s.free()


def test_default_comm_is_a_duplicate_of_world(strategy):
    assert strategy.comm != MPI.COMM_WORLD
    assert MPI.Comm.Compare(strategy.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert strategy.num_replicas_in_sync == MPI.COMM_WORLD.size
    assert strategy.rank == MPI.COMM_WORLD.rank


def test_given_comm_is_used_as_is():
    sub = MPI.COMM_WORLD.Split(color=MPI.COMM_WORLD.rank % 2, key=MPI.COMM_WORLD.rank)
    s = MPIStrategy(comm=sub)
    assert s.comm is sub and s.num_replicas_in_sync == sub.size and s.rank == sub.rank
    total = s.reduce("sum", PerReplica({s.rank: np.array(1.0)}))
    assert total == sub.size
    s.free()
    sub.Free()


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match=r"unknown mpidist option.*timout"):
        MPIStrategy(timout=3)


def test_scope_and_contexts(strategy):
    assert md.get_strategy() is None and md.get_replica_context() is None
    assert not md.in_cross_replica_context()
    with strategy.scope() as s:
        assert s is strategy and md.get_strategy() is strategy
        assert md.in_cross_replica_context() and md.get_replica_context() is None

        def fn():
            ctx = md.get_replica_context()
            assert not md.in_cross_replica_context() and md.get_strategy() is strategy
            return ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.strategy

        rid, n, st = strategy.run(fn)
        assert rid.get() == strategy.rank and n.get() == strategy.num_replicas_in_sync and st is strategy
    assert md.get_strategy() is None


def test_two_strategies_do_not_mix(strategy):
    other = MPIStrategy()
    with strategy.scope():
        with pytest.raises(RuntimeError, match="another strategy"), other.scope():
            pass
        with pytest.raises(RuntimeError, match="another strategy"):
            other.run(lambda: None)
    other.free()


def test_run_unwraps_per_replica_and_passes_the_rest(strategy):
    r = strategy.rank
    mirrored = Mirrored({r: np.arange(3.0)})
    plain = object()
    nested = {"x": PerReplica({r: np.full(2, float(r))}), "list": [PerReplica({r: r * 10}), 5]}
    seen = {}

    def fn(nest, m, p, scale=1):
        seen.update(nest=nest, m=m, p=p, scale=scale)
        return nest["x"] * scale, p, Pair(a=nest["list"][0], b=np.ones(1))

    with strategy.scope():
        out = strategy.run(fn, args=(nested, mirrored, plain), kwargs={"scale": PerReplica({r: 3})})
    assert_equal(seen["nest"]["x"], np.full(2, float(r)))
    assert seen["nest"]["list"] == [r * 10, 5]
    assert seen["m"] is mirrored and seen["p"] is plain and seen["scale"] == 3
    assert isinstance(out[0], PerReplica) and out[1] is plain and isinstance(out[2], Pair)
    assert_equal(out[0].get(), np.full(2, 3.0 * r))
    assert isinstance(out[2].a, PerReplica) and out[2].a.get() == r * 10
    assert out[0].replica_ids == (r,)


def test_run_returns_variables_as_themselves(strategy):
    with strategy.scope():
        v = md.Variable(np.zeros(2), name="run_var")
        out = strategy.run(lambda: (v, v.component, v.read_value()))
    assert out[0] is v and out[1] is v and out[2] is v


def test_run_inside_run_is_an_error(strategy):
    with strategy.scope(), pytest.raises(RuntimeError, match=r"inside strategy\.run"):
        strategy.run(lambda: strategy.run(lambda: None))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "complex128"])
def test_reduce_sum_and_mean(strategy, dtype):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    per_replica = PerReplica({r: (np.arange(4) + r).astype(dtype)})
    for _ in range(2):
        total = strategy.reduce(ReduceOp.SUM, per_replica)
        assert_equal(total, (np.arange(4) * n + sum(range(n))).astype(dtype))
        assert total.dtype == np.dtype(dtype)
        mean = strategy.reduce("mean", per_replica)
        assert_close(mean, np.arange(4) + (n - 1) / 2)
        # a Mirrored value contributes its (identical) component from every replica
        assert_equal(strategy.reduce("sum", Mirrored({r: np.ones(3, dtype)})), np.full(3, n, dtype))
        assert strategy.reduce("mean", 2.0) == 2.0 and strategy.reduce("sum", 2) == 2 * n


def test_reduce_with_axis_is_exact_for_unequal_batches(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    rows = {q: np.arange(q + 1, dtype=np.float64) + 10 * q for q in range(n)}  # rank q holds q+1 rows
    everything = np.concatenate([rows[q] for q in range(n)])
    local = PerReplica({r: rows[r]})
    for _ in range(2):
        assert strategy.reduce("sum", local, axis=0) == everything.sum()
        assert strategy.reduce("mean", local, axis=0) == pytest.approx(everything.mean(), rel=1e-15)
    two_d = PerReplica({r: np.ones((r + 1, 3)) * (r + 1)})
    assert_close(
        strategy.reduce("mean", two_d, axis=0),
        np.full(3, sum((q + 1) ** 2 for q in range(n)) / sum(q + 1 for q in range(n))),
    )


def test_reduce_of_a_nest(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    out = strategy.reduce("sum", {"a": PerReplica({r: np.ones(2)}), "b": [PerReplica({r: np.array(r)})]})
    assert_equal(out["a"], np.full(2, n))
    assert out["b"][0] == sum(range(n))


def test_gather_unequal_lengths_and_axis(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    for _ in range(2):
        out = strategy.gather(PerReplica({r: np.full((r + 1, 2), r)}))
        assert_equal(out, np.concatenate([np.full((q + 1, 2), q) for q in range(n)]))
        out1 = strategy.gather(PerReplica({r: np.full((2, r + 1), r)}), axis=1)
        assert_equal(out1, np.concatenate([np.full((2, q + 1), q) for q in range(n)], axis=1))


def test_experimental_local_results(strategy):
    r = strategy.rank
    assert strategy.experimental_local_results(PerReplica({r: 7})) == (7,)
    assert strategy.experimental_local_results(5) == (5,)


def test_broadcast_and_barrier(strategy):
    for root in range(strategy.num_replicas_in_sync):
        out = strategy.broadcast(np.full(3, strategy.rank), root=root)
        assert_equal(out, np.full(3, root))
    strategy.barrier()


def test_merge_call_wraps_arrays_and_returns_local_components(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank

    def merge_fn(s, value, scale, label="x"):
        assert s is strategy and md.in_cross_replica_context() and md.get_replica_context() is None
        assert isinstance(value, PerReplica) and scale == 2 and label == "y"
        return s.reduce("sum", value) * scale, PerReplica({r: r})

    def fn():
        return md.get_replica_context().merge_call(merge_fn, args=(np.full(2, r + 1.0), 2), kwargs={"label": "y"})

    with strategy.scope():
        total, mine = strategy.run(fn)
    assert_equal(total.get(), np.full(2, 2.0 * n * (n + 1) / 2))
    assert mine.get() == r


def test_run_and_merge_call_refuse_args_that_are_not_a_tuple_or_list(strategy):
    # args=x for args=(x,) would unpack an array's rows (or a string's characters) into the call.
    r = strategy.rank
    with strategy.scope():
        with pytest.raises(TypeError, match=rf"rank {r}: strategy\.run: args must be a tuple or list.*ndarray"):
            strategy.run(lambda x: x, args=np.ones(2))
        with pytest.raises(TypeError, match=r"strategy\.run: kwargs must be a dict.*list"):
            strategy.run(lambda **k: k, kwargs=[("a", 1)])

        def fn():
            ctx = md.get_replica_context()
            with pytest.raises(TypeError, match=rf"rank {r}: merge_call: args must be a tuple or list.*str"):
                ctx.merge_call(lambda s, *a: a, args="ab")
            return ctx.merge_call(lambda s, x, y=0: x.get() + y, args=[np.ones(2)], kwargs={"y": 1})

        assert_equal(strategy.run(fn).get(), np.full(2, 2.0))
        assert_equal(strategy.run(lambda x: x, args=[np.ones(2)]).get(), np.ones(2))


def test_replica_all_reduce_of_a_nest(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank

    def fn():
        ctx = md.get_replica_context()
        return ctx.all_reduce("sum", {"g": np.full(3, r, np.float32), "h": [np.array(1)]}), ctx.all_reduce(
            ReduceOp.MEAN, np.array(float(r))
        )

    with strategy.scope():
        nest, mean = strategy.run(fn)
    assert_equal(nest["g"].get(), np.full(3, sum(range(n)), np.float32))
    assert nest["h"][0].get() == n and mean.get() == (n - 1) / 2


def test_strategy_works_in_a_one_rank_world():
    s = MPIStrategy(comm=MPI.COMM_SELF)
    with s.scope():
        v = md.Variable(np.ones(2), aggregation="mean")
        s.run(lambda: v.assign_add(np.ones(2)))
    assert_equal(v.numpy(), [2.0, 2.0])
    assert s.num_replicas_in_sync == 1
    s.free()


def test_values_holding_every_replicas_component_use_this_ranks(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    everyone = PerReplica({q: np.array([q + 1.0, 10.0 * q]) for q in range(n)})  # built alike on every rank

    def fn(x):
        assert_equal(x, [r + 1.0, 10.0 * r])  # run unwrapped this rank's component
        assert_equal(everyone.get(), [r + 1.0, 10.0 * r])  # get() without an id: the current replica's
        return md.get_replica_context().all_reduce("sum", everyone)

    with strategy.scope():
        total = strategy.run(fn, args=(everyone,))
        expected = [n * (n + 1) / 2, 10.0 * n * (n - 1) / 2]
        assert_equal(total.get(), expected)
        assert_equal(strategy.reduce("sum", everyone), expected)
        assert_equal(strategy.gather(PerReplica({q: np.full(1, q) for q in range(n)})), np.arange(n))
        if n > 1:
            with pytest.raises(ValueError, match="pass replica_id"):
                everyone.get()  # cross-replica context: no current replica


@pytest.mark.parametrize("op", [md.VariableAggregation.ONLY_FIRST_REPLICA, "only_first_replica", "ONLY_FIRST_REPLICA"])
def test_reduce_accepts_only_first_replica(strategy, op):
    r = strategy.rank
    value = PerReplica({r: np.array([r + 1.0, -2.0 * r])})
    with strategy.scope():
        for _ in range(2):
            first = strategy.reduce(op, value)
            assert_equal(first, [1.0, 0.0])
            assert_equal(value.get(), [r + 1.0, -2.0 * r])  # the argument is left as it was
            nest = strategy.reduce(op, {"a": value, "b": [np.int64(r + 5)]})
            assert_equal(nest["a"], [1.0, 0.0])
            assert int(nest["b"][0]) == 5 and float(strategy.reduce(op, np.float64(r + 2.5))) == 2.5
            assert_equal(strategy.reduce_async(op, [value, np.array(r)]).wait()[0], [1.0, 0.0])
            in_replica = strategy.run(lambda: md.get_replica_context().all_reduce(op, np.array(float(r + 7))))
            assert float(in_replica.get()) == 7.0


def test_reduce_accepts_sum_and_mean_aggregations_and_refuses_none(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    value = PerReplica({r: np.array([float(r)])})
    with strategy.scope():
        assert_equal(strategy.reduce(md.VariableAggregation.SUM, value), [n * (n - 1) / 2])
        assert_close(strategy.reduce(md.VariableAggregation.MEAN, value), [(n - 1) / 2])
        assert_equal(strategy.reduce_async(md.VariableAggregation.MEAN, value).wait(), [(n - 1) / 2])
        for none in (md.VariableAggregation.NONE, "none"):
            with pytest.raises(ValueError, match=rf"rank {r}: VariableAggregation.NONE"):
                strategy.reduce(none, value)
        with pytest.raises(ValueError, match="unknown reduce op 'median'"):
            strategy.reduce("median", value)
        with pytest.raises(ValueError, match="no axis"):
            strategy.reduce("only_first_replica", value, axis=0)


def test_reduce_into_out_allocates_nothing_and_refuses_a_wrong_out(strategy):
    n, rank = strategy.num_replicas_in_sync, strategy.rank
    values = [np.full((3, 2), rank + 1.0), np.arange(5, dtype=np.float32) * (rank + 1)]
    out = [np.empty((3, 2)), np.empty(5, np.float32)]
    total = sum(r + 1 for r in range(n))
    for _ in range(2):
        got = strategy.reduce("sum", values, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        np.testing.assert_array_equal(out[0], np.full((3, 2), float(total)))
        np.testing.assert_array_equal(out[1], np.arange(5, dtype=np.float32) * total)
    wrong = [np.empty((3, 2)), np.empty(4, np.float32)] if rank == n - 1 else out
    with pytest.raises((ValueError, md.CollectiveMismatchError), match=f"rank {n - 1}"):
        strategy.reduce("mean", values, out=wrong)
    np.testing.assert_array_equal(strategy.reduce("sum", np.ones(1)), [n])  # still usable


def test_a_rank_that_left_a_step_by_an_exception_is_named_at_its_next_collective():
    """The last rank's merge_fn raises; the others reduce inside it. The last rank's next collective has the same
    identity as their reduce, yet every rank raises instead of pairing them, naming the rank that left the step;
    afterwards every rank has left one step, and the collectives pair again."""
    s = MPIStrategy(device="cpu", abort_on_error=False, timeout=30)
    n, last = s.num_replicas_in_sync, s.num_replicas_in_sync - 1
    if n == 1:
        s.free()
        pytest.skip("one rank cannot leave a step alone")

    def merge(strategy, x):
        if strategy.rank == last:
            raise KeyError("only on the last rank")
        return strategy.reduce("sum", x)

    step = lambda: md.get_replica_context().merge_call(merge, args=(np.ones(3),))  # noqa: E731
    try:
        if s.rank == last:
            with pytest.raises(KeyError):
                s.run(step)
        with pytest.raises(md.CollectiveMismatchError) as caught:
            if s.rank == last:
                s.reduce("sum", np.ones(3))  # what the others make inside merge_fn
            else:
                s.run(step)
        text = str(caught.value)
        assert f"rank {last}: #" in text and "after leaving 1 step by an exception (KeyError in merge_call)" in text
        assert s.communicator.steps_left == 1
        assert s.reduce("sum", np.ones(2)).tolist() == [n, n]  # every rank left one step: alike again
    finally:
        s.free()


@pytest.mark.parametrize("where", ["strategy.run", "merge_call"])
def test_a_rank_whose_call_arguments_are_refused_has_left_the_step(where):
    """The last rank passes ``args=5`` (not a tuple) to strategy.run or to merge_call, and catches merge_call's
    TypeError inside fn; the others reduce inside merge_fn. The refusal comes before fn (merge_fn) starts, yet that
    rank has left the step as by an exception from it: its next collective (the same reduce) raises on every rank,
    naming it, instead of pairing with theirs."""
    s = MPIStrategy(device="cpu", abort_on_error=False, timeout=30)
    n, last = s.num_replicas_in_sync, s.num_replicas_in_sync - 1
    if n == 1:
        s.free()
        pytest.skip("one rank cannot leave a step alone")
    bad = s.rank == last

    def merge(strategy, x):
        return strategy.reduce("sum", x)

    def fn(x):
        try:
            return md.get_replica_context().merge_call(merge, args=5 if bad and where == "merge_call" else (x,))
        except TypeError as exc:  # caught inside fn: strategy.run itself returns normally
            return exc

    step = lambda: s.run(fn, args=5 if bad and where == "strategy.run" else (np.ones(3),))  # noqa: E731
    refused = f"rank {last}: {where}: args must be a tuple or list of positional arguments, got int"
    try:
        if bad and where == "strategy.run":
            with pytest.raises(TypeError, match=refused):
                step()
        elif bad:
            error = step()
            assert isinstance(error, TypeError) and refused in str(error)
        with pytest.raises(md.CollectiveMismatchError) as caught:
            if bad:
                s.reduce("sum", np.ones(3))  # what the others make inside merge_fn
            else:
                step()
        assert f"rank {last}: #" in str(caught.value)
        assert f"after leaving 1 step by an exception (TypeError in {where})" in str(caught.value)
        assert s.reduce("sum", np.ones(2)).tolist() == [n, n]  # every rank left one step: alike again
    finally:
        s.free()
