"""Coordinated stops: a stop requested on some ranks is seen by every rank at the same step.

MPI tests (1, 2 and 3 ranks): with collective checks on, the request rides the next
agreement record; with every check off, ``should_stop(check_every=k)`` checks every k-th call.
Serial tests: signal names, and a one-rank world. The same stop under a real Slurm, signalled
by it, is the system test ``tests/system/test_preemption_slurm.py``.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import mpidist as md
from mpidist._distribute.preemption import signal_numbers

STEPS = 20


def _loop(strategy, request_at, requester, check_every=10, by_signal=False):
    """Steps with one reduction each; ``requester`` asks at step ``request_at``. Returns the stop step."""
    x = np.ones(3, dtype=np.float32)
    for step in range(STEPS):
        if step == request_at and strategy.rank == requester:
            if by_signal:
                os.kill(os.getpid(), signal.SIGUSR1)
            else:
                strategy.request_stop()
        total = strategy.reduce("sum", x)
        assert total[0] == strategy.num_replicas_in_sync
        if strategy.should_stop(check_every=check_every):
            return step
    return None


def _all_steps(strategy, step):
    return strategy.comm.allgather(step)


@pytest.mark.mpi
@pytest.mark.parametrize("requester", ["first", "last"])
def test_stop_seen_by_every_rank_at_the_same_step(requester):
    strategy = md.MPIStrategy(device="cpu")
    try:
        for _ in range(2):  # twice: a fresh strategy each time starts unstopped
            fresh = md.MPIStrategy(device="cpu")
            who = 0 if requester == "first" else fresh.num_replicas_in_sync - 1
            stopped = _loop(fresh, request_at=3, requester=who)
            steps = _all_steps(fresh, stopped)
            assert steps == [3] * fresh.num_replicas_in_sync
            assert fresh.should_stop()  # stays True
            fresh.free()
    finally:
        strategy.free()


@pytest.mark.mpi
@pytest.mark.parametrize("requester", ["first", "last"])
def test_a_stop_asked_after_a_steps_last_collective_stops_every_rank_one_step_later(requester):
    """The race the design exists for: the request comes after the step's last collective, before should_stop().

    No record carried it yet, so no rank, the requester included, stops at this step; the next
    step's record carries it, and every rank stops there. A requester that stopped at once would
    leave the others in the next step's collective.
    """
    strategy = md.MPIStrategy(device="cpu", timeout=30)
    try:
        n = strategy.num_replicas_in_sync
        who = 0 if requester == "first" else n - 1
        x = np.ones(3)
        stopped = None
        for step in range(STEPS):
            strategy.reduce("sum", x)  # the step's last collective
            if step == 3 and strategy.rank == who:
                strategy.request_stop()  # as a signal arriving here would
            if strategy.should_stop():
                stopped = step
                break
        # through mpidist, so that ranks stopped at different steps fail with an error instead of waiting
        steps = strategy.gather(np.array([-1 if stopped is None else stopped]))
        assert steps.tolist() == [3 if n == 1 else 4] * n  # a rank alone needs nobody: it stops at once
    finally:
        strategy.free()


@pytest.mark.mpi
def test_stop_with_checks_off_is_seen_within_check_every_calls():
    strategy = md.MPIStrategy(device="cpu", check_collectives=False, timeout=None, check_finite=False)
    try:
        n = strategy.num_replicas_in_sync
        stopped = _loop(strategy, request_at=5, requester=n - 1, check_every=4)
        # calls 4, 8, 12, ... check (steps 3, 7, 11, ...): the request at step 5 is seen at step 7;
        # a one-rank world needs nobody's agreement and stops at once
        expected = 5 if n == 1 else 7
        assert _all_steps(strategy, stopped) == [expected] * n
    finally:
        strategy.free()


@pytest.mark.mpi
def test_signal_on_one_rank_stops_every_rank_at_the_same_step():
    strategy = md.MPIStrategy(device="cpu")
    previous = strategy.stop_on_signals(signal.SIGUSR1)
    try:
        n = strategy.num_replicas_in_sync
        stopped = _loop(strategy, request_at=2, requester=n - 1, by_signal=True)
        assert _all_steps(strategy, stopped) == [2] * n
        got = strategy.comm.allgather(strategy.stop_signal)
        assert got == [None] * (n - 1) + [int(signal.SIGUSR1)]
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        strategy.free()


@pytest.mark.mpi
def test_checkpoint_after_agreed_stop_restores_the_same_step(tmp_path_factory):
    strategy = md.MPIStrategy(device="cpu")
    directory = strategy.comm.bcast(str(tmp_path_factory.mktemp("stop")) if strategy.rank == 0 else None)
    try:
        with strategy.scope():
            w = md.Variable(np.zeros(4, np.float32), name="w", aggregation=md.VariableAggregation.MEAN)
        step_done = np.zeros((), np.int64)
        checkpoint = md.Checkpoint(w=w, step=step_done)
        for step in range(STEPS):
            if step == 4 and strategy.rank == strategy.num_replicas_in_sync - 1:
                strategy.request_stop()
            strategy.run(lambda: w.assign_add(np.full(4, float(strategy.rank), np.float32)))
            step_done[...] = step + 1
            if strategy.should_stop():
                checkpoint.save(directory)
                break
        restored = md.read_checkpoint(directory)
        n = strategy.num_replicas_in_sync
        assert int(restored["step"]) == 5
        np.testing.assert_allclose(restored["w"], np.full(4, 5 * (n - 1) / 2, np.float32))
    finally:
        strategy.free()


def test_signal_names():
    assert signal_numbers(("USR1", "sigterm", signal.SIGUSR2, 1)) == (
        int(signal.SIGUSR1),
        int(signal.SIGTERM),
        int(signal.SIGUSR2),
        1,
    )
    with pytest.raises(ValueError, match="unknown signal"):
        signal_numbers(("NOPE",))
    with pytest.raises(TypeError):
        signal_numbers((1.5,))


def test_one_rank_stops_at_the_next_check():
    strategy = md.MPIStrategy(device="cpu")
    try:
        if strategy.num_replicas_in_sync != 1:
            pytest.skip("one-rank world only")
        assert not strategy.should_stop()
        strategy.request_stop()
        assert strategy.should_stop() and strategy.should_stop()
    finally:
        strategy.free()


def test_a_bad_check_every_raises_whatever_the_collective_checks():
    """check_every is used only with every check off; a bad one raises with checks on too, not first when
    a program turns the checks off."""
    for options in ({}, {"check_collectives": False, "timeout": None, "check_finite": False}):
        strategy = md.MPIStrategy(device="cpu", **options)
        try:
            for bad in (0, -1, 2.5):
                with pytest.raises(ValueError, match=f"check_every must be a positive int, got {bad}"):
                    strategy.should_stop(check_every=bad)
            assert strategy.should_stop(check_every=3) is False
        finally:
            strategy.free()
