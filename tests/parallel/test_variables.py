"""Mirrored and sync-on-read variables (api-contract C5) under mpiexec at 1, 2 and 3 ranks.

Expected values are derived from rank and size. After every replica-context
update of a mirrored variable the components are checked to be bitwise
identical on all ranks by gathering their bytes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest

import mpidist as md
from arrays import DEVICES, assert_close, assert_equal, host
from mpidist import (
    CollectiveMismatchError,
    MirroredVariable,
    MPIStrategy,
    SyncOnReadVariable,
    Variable,
    VariableAggregation as Agg,
    VariableSynchronization as Sync,
)

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=DEVICES)
def strategy(request):
    s = MPIStrategy(device=request.param)
    yield s
    s.free()


def assert_bitwise_identical(strategy, var):
    """Gather every rank's component bytes and compare them row by row (collective)."""
    raw = np.frombuffer(host(var.component).tobytes(), dtype=np.uint8)
    rows = strategy.gather(md.PerReplica({strategy.rank: raw[None, :]}))
    assert rows.shape[0] == strategy.num_replicas_in_sync
    for q in range(1, rows.shape[0]):
        assert (rows[q] == rows[0]).all(), f"{var.name}: rank {q}'s component differs from rank 0's"


def test_creation_broadcasts_rank_zero_value(strategy):
    rng = np.random.default_rng(1234 + strategy.rank)  # a different random value on every rank
    rank0_rng = np.random.default_rng(1234)  # replays rank 0's draws
    with strategy.scope():
        for _ in range(2):
            v = Variable(lambda: rng.standard_normal((3, 4)), name="w")
            assert isinstance(v, MirroredVariable) and isinstance(v, md.Mirrored)
            assert v.name == "w" and v.shape == (3, 4) and v.dtype == np.float64
            assert v.aggregation is Agg.NONE and v.synchronization is Sync.ON_WRITE
            assert_bitwise_identical(strategy, v)
            assert_equal(v.numpy(), rank0_rng.standard_normal((3, 4)))
            assert type(v.component) is strategy.backend.xp.ndarray


def test_creation_dtype_and_names(strategy):
    with strategy.scope():
        a = Variable(3, dtype=np.float32)
        b = Variable([1, 2], synchronization=Sync.ON_READ, aggregation=Agg.SUM)
    assert a.dtype == np.float32 and a.shape == ()
    assert isinstance(b, SyncOnReadVariable) and isinstance(b, md.PerReplica) and b.dtype == np.int64
    assert a.name != b.name


@pytest.mark.parametrize("device", DEVICES)
def test_default_names_count_per_strategy(device):
    for _ in range(2):  # a second strategy starts again from "Variable"
        s = MPIStrategy(device=device)
        with s.scope():
            names = [
                Variable(0.0).name,
                Variable(1.0, name="w").name,
                Variable(2.0).name,
                Variable(3.0, synchronization=Sync.ON_READ).name,
            ]
        assert names == ["Variable", "w", "Variable_1", "Variable_2"]
        s.free()


def test_conversion_of_mirrored_variables_is_the_local_component(strategy):
    r = strategy.rank
    with strategy.scope():
        v = Variable(np.array([1.0, 2.0]), aggregation=Agg.SUM)
        if strategy.backend.is_gpu:
            cp = strategy.backend.xp
            assert cp.asarray(v).data.ptr == v.component.data.ptr
            assert v.__cuda_array_interface__["data"][0] == v.component.data.ptr
            assert_equal(cp.from_dlpack(v), [1.0, 2.0])
            with pytest.raises(TypeError):
                np.asarray(v)  # no implicit device-to-host copy, as for the component itself
        else:
            a = np.asarray(v)
            assert a.dtype == np.float64 and np.shares_memory(a, v.component)
            assert_equal(np.asarray(v, dtype=np.float32), np.array([1, 2], dtype=np.float32))
            assert_equal(np.from_dlpack(v), [1.0, 2.0])
            assert not hasattr(v, "__cuda_array_interface__")
        strategy.run(lambda: v.assign_add(np.array([r + 1.0, 0.0])))
        assert_equal(
            host(v.__array__()) if not strategy.backend.is_gpu else host(v.component),
            [1.0 + sum(range(1, strategy.num_replicas_in_sync + 1)), 2.0],
        )


@pytest.mark.parametrize("agg", [Agg.SUM, Agg.MEAN])
def test_conversion_of_sync_on_read_variables_is_never_collective(strategy, agg):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    xp = strategy.backend.xp
    with strategy.scope():
        v = Variable(np.zeros(2), synchronization=Sync.ON_READ, aggregation=agg)
    strategy.run(lambda: v.assign(np.array([r, 10.0 * r])))
    # replica context and outside any scope: the local component, without communication
    inside = strategy.run(lambda: xp.asarray(v)).get()
    assert_equal(inside, [r, 10.0 * r])
    assert_equal(xp.asarray(v), [r, 10.0 * r])
    if r == 0:  # only rank 0 converts: a collective here would hang the others
        with strategy.scope():
            with pytest.raises(TypeError, match=r"read_value\(\).*strategy\.read_var"):
                np.asarray(v)
            with pytest.raises(TypeError, match="cross-replica context"):
                xp.asarray(v)
            assert "SyncOnReadVariable" in repr(v)  # printing stays local
    total = sum(range(n)) / (n if agg is Agg.MEAN else 1)
    assert_close(strategy.read_var(v), [total, 10.0 * total])


def test_checkpoint_save_warns_once_for_a_sync_on_read_variable_without_aggregation(strategy):
    world = strategy.comm
    path = world.bcast(tempfile.mkdtemp(prefix="mpidist-none-") if world.rank == 0 else None)
    n = strategy.num_replicas_in_sync
    try:
        with strategy.scope():
            v = Variable(np.ones(2), name="none_counter", synchronization=Sync.ON_READ)
            w = Variable(np.ones(2), name="sum_counter", synchronization=Sync.ON_READ, aggregation=Agg.SUM)
        ckpt = md.Checkpoint(v=v, w=w)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            ckpt.save(os.path.join(path, "a"))
            ckpt.save(os.path.join(path, "b"))
        messages = [str(x.message) for x in record if issubclass(x.category, UserWarning)]
        assert len(messages) == 1 and "'none_counter' has aggregation NONE" in messages[0], messages
        assert "does not round-trip" in messages[0] and f"rank {strategy.rank}" in messages[0]
        ckpt.restore(os.path.join(path, "b"))
        assert_close(strategy.read_var(w), [n, n])
        assert_close(strategy.read_var(v), [n * n, n * n])  # NONE: the saved sum lands on every component
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("agg", [Agg.SUM, Agg.MEAN, Agg.ONLY_FIRST_REPLICA])
def test_replica_update_with_a_constant_under_sum_adds_n_times(strategy, agg):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = Variable(0.0, aggregation=agg)
    strategy.run(lambda: v.assign_add(1.0))
    assert_equal(v.numpy(), n if agg is Agg.SUM else 1.0)


@pytest.mark.parametrize("agg", [Agg.SUM, Agg.MEAN, Agg.ONLY_FIRST_REPLICA])
def test_mirrored_replica_updates_aggregate(strategy, agg):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    contributions = [np.array([q + 1.0, 0.1 * (q + 1)]) for q in range(n)]
    combined = {
        Agg.SUM: sum(contributions),
        Agg.MEAN: sum(contributions) / n,
        Agg.ONLY_FIRST_REPLICA: contributions[0],
    }[agg]
    with strategy.scope():
        v = Variable(np.array([10.0, 20.0]), name=f"m_{agg.name}", aggregation=agg)
        expect = np.array([10.0, 20.0])
        for kind in ("assign_add", "assign_sub", "assign", "assign_add"):
            result = strategy.run(lambda: getattr(v, kind)(contributions[r]))
            assert result is v
            expect = {"assign_add": expect + combined, "assign_sub": expect - combined, "assign": combined}[kind]
            assert_close(v.numpy(), expect, rtol=1e-14)
            assert_bitwise_identical(strategy, v)


def test_mirrored_replica_update_without_aggregation_raises(strategy):
    with strategy.scope():
        v = Variable(np.zeros(2), name="no_agg")
        with pytest.raises(ValueError, match="'no_agg' in replica context needs an aggregation"):
            strategy.run(lambda: v.assign_add(np.ones(2)))
    assert_equal(v.numpy(), [0.0, 0.0])


def test_mirrored_cross_replica_updates_apply_as_given(strategy):
    with strategy.scope():
        v = Variable(np.ones(3), name="cross", aggregation=Agg.SUM)
        v.assign_add(np.full(3, 2.0))
        v.assign_sub(1.0)  # broadcasts against the shape
        assert_equal(v.read_value(), np.full(3, 2.0))
        v.assign([7.0, 8.0, 9.0])
        assert_equal(v.numpy(), [7.0, 8.0, 9.0])
        out = strategy.update(
            v, lambda c, d: c.__imul__(d), md.Mirrored({strategy.rank: strategy.backend.asarray(2.0)})
        )
        assert out is v.component
        assert_equal(strategy.read_var(v), [14.0, 16.0, 18.0])
        with pytest.raises(TypeError, match="PerReplica"):
            strategy.update(v, lambda c, d: None, md.PerReplica({strategy.rank: 1.0}))
        assert_bitwise_identical(strategy, v)


def test_mirrored_variable_delegates_like_mirrored(strategy):
    with strategy.scope():
        v = Variable(np.array([1.0, 2.0, 3.0]), name="delegate")
    assert_equal(v + 1, [2.0, 3.0, 4.0])
    assert_equal(2 * v, [2.0, 4.0, 6.0])
    assert_equal(strategy.backend.xp.asarray(v), [1.0, 2.0, 3.0])
    assert v[1] == 2.0 and v.sum() == 6.0 and (v > 1.5).tolist() == [False, True, True]


@pytest.mark.parametrize("agg", [Agg.SUM, Agg.MEAN, Agg.ONLY_FIRST_REPLICA, Agg.NONE])
def test_sync_on_read_local_updates_and_reduced_reads(strategy, agg):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        v = Variable(np.zeros(2), name=f"sor_{agg.name}", synchronization=Sync.ON_READ, aggregation=agg)

        def step():
            v.assign_add(np.array([r + 1.0, 1.0]))
            v.assign_sub(np.array([0.0, 0.5]))
            return v.read_value()

        local = strategy.run(step)
        assert_equal(local.get() if isinstance(local, md.PerReplica) else local.component, [r + 1.0, 0.5])
        components = [np.array([q + 1.0, 0.5]) for q in range(n)]
        want = {
            Agg.SUM: sum(components),
            Agg.NONE: sum(components),
            Agg.MEAN: sum(components) / n,
            Agg.ONLY_FIRST_REPLICA: components[0],
        }[agg]
        for _ in range(2):
            assert_close(v.read_value(), want)
            assert_close(v.numpy(), want)
            assert_close(strategy.read_var(v), want)
        assert_equal(v.component, [r + 1.0, 0.5])  # reading changed nothing


@pytest.mark.parametrize("agg", [Agg.SUM, Agg.MEAN, Agg.NONE, Agg.ONLY_FIRST_REPLICA])
def test_sync_on_read_cross_replica_assign(strategy, agg):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = Variable(np.zeros(3), name="sor_assign", synchronization=Sync.ON_READ, aggregation=agg)
        v.assign(np.array([3.0, 6.0, 9.0]))
        assert_close(v.component, np.array([3.0, 6.0, 9.0]) / (n if agg is Agg.SUM else 1))
        # NONE reads as SUM, so a value assigned unchanged to every component reads back n times.
        assert_close(v.read_value(), np.array([3.0, 6.0, 9.0]) * (n if agg is Agg.NONE else 1))
        with pytest.raises(RuntimeError, match="only allowed in replica context"):
            v.assign_add(1.0)
        with pytest.raises(RuntimeError, match="only allowed in replica context"):
            v.assign_sub(1.0)


def test_integer_sum_counter_splits_exactly(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        c = Variable(np.zeros(3, dtype=np.int64), name="count", synchronization=Sync.ON_READ, aggregation=Agg.SUM)
        c.assign(np.array([10, 1, 0]))
        shares = [np.array([10 // n + (q < 10 % n), 1 // n + (q < 1 % n), 0]) for q in range(n)]
        assert_equal(c.component, shares[r])
        assert_equal(c.read_value(), [10, 1, 0])
        strategy.run(lambda: c.assign_add(np.array([1, 1, 1])))
        assert_equal(c.read_value(), [10 + n, 1 + n, n])
        with pytest.raises(TypeError, match="would truncate"):
            strategy.run(lambda: c.assign_add(np.array([0.5, 0.5, 0.5])))


def test_complex_values_do_not_update_a_real_variable_on_any_rank(strategy):
    # Casting would drop the imaginary parts (numpy only warns); the rank that passes them raises, the
    # others raise CollectiveMismatchError naming it, and no component changes.
    n, r = strategy.num_replicas_in_sync, strategy.rank
    last = n - 1
    with strategy.scope():
        v = Variable(np.zeros(3, np.float32), name="real", aggregation=Agg.SUM)
        value = np.full(3, 1 + 2j, np.complex64) if r == last else np.ones(3, np.float32)
        expected = (
            (TypeError, "'real' has real dtype float32.*complex64.*imaginary")
            if r == last
            else (
                CollectiveMismatchError,
                f"rank {last}",
            )
        )
        with pytest.raises(expected[0], match=expected[1]):
            strategy.run(lambda: v.assign_add(value))
        with pytest.raises(TypeError, match="imaginary"):
            v.assign(np.full(3, 1j))  # cross-replica: the same value on every rank
        assert_equal(v.component, np.zeros(3, np.float32))
        strategy.run(lambda: v.assign_add(np.ones(3, np.float64)))  # a real value of another dtype is cast
        assert_equal(v.component, np.full(3, n, np.float32))


def test_integer_mean_is_rejected(strategy):
    with strategy.scope():
        for sync in (Sync.ON_WRITE, Sync.ON_READ):
            with pytest.raises(ValueError, match="'imean' has integer dtype int64: MEAN"):
                Variable(np.zeros(2, np.int64), name="imean", synchronization=sync, aggregation=Agg.MEAN)


def test_variable_outside_scope_raises():
    with pytest.raises(RuntimeError, match=r"strategy\.scope"):
        Variable(1.0)


def test_variable_shape_mismatch_across_ranks_names_the_variable(strategy):
    if strategy.num_replicas_in_sync == 1:
        pytest.skip("needs two ranks to disagree")
    shapes = r"'mismatched'.*float64\[2\].*float64\[3\]"
    with strategy.scope(), pytest.raises(CollectiveMismatchError, match=shapes):
        Variable(np.zeros(2 + strategy.rank % 2), name="mismatched")


def test_update_shape_errors_name_the_variable(strategy):
    with strategy.scope():
        v = Variable(np.zeros(2), name="shaped", aggregation=Agg.SUM)
        with pytest.raises(ValueError, match="'shaped' of shape \\(2,\\) with a value of shape \\(3,\\)"):
            strategy.run(lambda: v.assign(np.zeros(3)))


def test_update_of_other_strategys_variable_is_rejected(strategy):
    other = MPIStrategy()
    with other.scope():
        v = Variable(np.zeros(1), name="foreign")
    with pytest.raises(ValueError, match="belongs to another strategy"):
        strategy.update(v, lambda c: None)
    other.free()
