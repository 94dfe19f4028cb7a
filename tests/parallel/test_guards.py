"""Mirror consistency and the non-finite guard (issue: errors instead of hangs), at 1, 2 and 3 ranks."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mpidist as md
from arrays import assert_equal
from mpidist import MirrorDivergenceError, MPIStrategy, NonFiniteError, Variable, VariableAggregation as Agg

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def strategy():
    s = MPIStrategy()
    yield s
    s.free()


def perturb_last_rank(strategy, var):
    """Change the last rank's component behind mpidist's back (a bug in user code)."""
    if strategy.rank == strategy.num_replicas_in_sync - 1:
        var.component[0] += 1.0


def test_check_mirrored_passes_when_identical(strategy):
    with strategy.scope():
        a = Variable(np.ones(4), name="a")
        b = Variable(np.zeros((2, 2), np.float32), name="b")
        for _ in range(2):
            assert strategy.check_mirrored([a, {"b": b}]) == {}


def test_check_mirrored_names_the_diverged_variable_and_ranks(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        ok = Variable(np.ones(3), name="ok")
        bad = Variable(np.ones(3), name="bad")
        perturb_last_rank(strategy, bad)
        if n == 1:
            assert strategy.check_mirrored([ok, bad]) == {}  # one replica cannot diverge
            return
        with pytest.raises(MirrorDivergenceError) as info:
            strategy.check_mirrored([ok, bad])
        assert info.value.diverged == {"bad": (n - 1,)}
        assert f"'bad' differs from rank 0's on rank {n - 1}" in str(info.value) and "'ok'" not in str(info.value)


def test_check_mirrored_repair_rebroadcasts_rank_zero(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = Variable(np.arange(3.0), name="repairable")
        perturb_last_rank(strategy, v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            repaired = strategy.check_mirrored([v], repair=True)
        assert repaired == ({} if n == 1 else {"repairable": (n - 1,)})
        assert_equal(v.numpy(), np.arange(3.0) + (1.0 if n == 1 else 0.0) * np.array([1, 0, 0]))
        assert strategy.check_mirrored([v]) == {}


def test_check_mirrored_rejects_other_values(strategy):
    with strategy.scope():
        s = Variable(np.ones(1), name="sor", synchronization=md.VariableSynchronization.ON_READ)
    with pytest.raises(TypeError, match="expects mirrored variables"):
        strategy.check_mirrored([s])


def test_periodic_mirror_check_catches_divergence_at_the_kth_update():
    s = MPIStrategy(check_mirrored_every=2)
    n = s.num_replicas_in_sync
    with s.scope():
        v = Variable(np.zeros(2), name="periodic", aggregation=Agg.SUM)
        s.run(lambda: v.assign_add(np.ones(2)))  # update 1: no check yet
        perturb_last_rank(s, v)
        if n == 1:
            s.run(lambda: v.assign_add(np.ones(2)))
        else:
            with pytest.raises(MirrorDivergenceError, match="'periodic' differs from rank 0's on rank"):
                s.run(lambda: v.assign_add(np.ones(2)))  # update 2: checked
    s.free()


def test_non_finite_guard_names_the_rank_and_keeps_values():
    s = MPIStrategy(check_finite=True)
    n, r = s.num_replicas_in_sync, s.rank
    with s.scope():
        w = Variable(np.ones(3), name="weights", aggregation=Agg.MEAN)
        grad = np.full(3, np.nan if r == n - 1 else 1.0)
        for _ in range(2):
            with pytest.raises(NonFiniteError) as info:
                s.run(lambda: w.assign_sub(grad))
            assert info.value.ranks == (n - 1,)
            assert f"rank {n - 1} contributed NaN or Inf" in str(info.value) and "'weights'" in str(info.value)
            assert_equal(w.numpy(), np.ones(3))  # nothing was applied
        s.run(lambda: w.assign_sub(np.full(3, 0.5)))  # finite updates still go through
        assert_equal(w.numpy(), np.full(3, 0.5))
        with pytest.raises(NonFiniteError):
            s.reduce("sum", md.PerReplica({r: np.array([np.inf if r == 0 else 0.0])}))
    s.free()


def test_without_the_guard_nan_spreads_as_mpi_computes_it():
    s = MPIStrategy(check_finite=False)
    out = s.reduce("sum", md.PerReplica({s.rank: np.array([np.nan if s.rank == 0 else 1.0])}))
    assert np.isnan(out[0])
    s.free()


def test_strategy_timeout_option_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "7.5")
    s = MPIStrategy()
    assert s.options.timeout == 7.5
    for _ in range(2):
        assert s.reduce("sum", 1.0) == s.num_replicas_in_sync  # the polled path gives right answers
    s.free()
