"""Fault tolerance on, nothing failing (1, 2 and 3 ranks): the collectives work as without it, and the recovery
calls refuse what is not theirs. Surviving dead ranks is checked on whole jobs in ``test_fault_tolerance.py``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mpidist import MPIStrategy, Variable
from mpidist._comm.survival import readiness

pytestmark = pytest.mark.mpi


@pytest.fixture
def strategy():
    with warnings.catch_warnings():  # rank 0 warns when the job was not started to survive (--with-ft ulfm)
        warnings.simplefilter("ignore", RuntimeWarning)
        s = MPIStrategy(device="cpu", fault_tolerance=True, abort_on_error=False, timeout=30, piece_bytes=4096)
    yield s
    s.free()


def test_collectives_and_updates_land_whole(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = Variable(np.zeros(5000), name="v", aggregation="mean")  # 40 KB: pieces of 4 KiB, deferred
    for _ in range(2):  # twice: the reused buffers
        strategy.run(lambda: v.assign_add(np.full(5000, strategy.rank + 1.0)))
    assert np.all(v.component == 2 * (n + 1) / 2)
    buffer = np.full(3000, 1.0 + strategy.rank)
    strategy.communicator.allreduce(buffer, inplace=True, name="buffer")  # through a copy, then written
    assert np.all(buffer == n * (n + 1) / 2)
    assert strategy.communicator.last_failure is None


def test_the_warning_that_dead_ranks_end_the_job_points_at_the_program():
    """Where the job cannot survive a dead rank (not started with --with-ft ulfm, or MPICH), rank 0 says so once,
    at the program's line that made the strategy, not inside mpidist."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = MPIStrategy(device="cpu", fault_tolerance=True, abort_on_error=False, timeout=30)  # the line shown
    made.free()
    said = [w for w in caught if "fault_tolerance is on, but dead ranks will" in str(w.message)]
    if made.rank != 0 or readiness()[0]:
        assert said == []
    else:
        [warning] = said
        assert (warning.filename, warning.category) == (__file__, RuntimeWarning)
        with open(__file__) as source:
            assert "# the line shown" in source.read().splitlines()[warning.lineno - 1]


def test_recover_without_a_failure_is_refused_on_every_rank(strategy):
    with pytest.raises(RuntimeError, match="no rank of this strategy died"):
        strategy.recover()
    strategy.barrier()  # still usable


def test_recover_with_fault_tolerance_off_says_so_on_every_rank():
    """Off, a dead rank leaves the survivors a CommError and nothing to recover: recover() says the mode is off
    rather than that no rank died."""
    plain = MPIStrategy(device="cpu", abort_on_error=False, timeout=30)
    try:
        with pytest.raises(RuntimeError, match="fault_tolerance is off") as raised:
            plain.recover()
        assert str(raised.value).startswith(f"rank {plain.rank}: ") and "no rank" not in str(raised.value)
        plain.barrier()  # still usable
    finally:
        plain.free()


def test_a_snapshot_takes_only_json_state(strategy):
    strategy.snapshot(epoch=1, position={"offset": 60})
    with pytest.raises(TypeError, match=rf"^rank {strategy.rank}: strategy.snapshot\(epoch=...\): .* got ndarray"):
        strategy.snapshot(step=3, epoch=np.zeros(2))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_reductions_give_the_bits_they_give_without_it(strategy, compression):
    """A compressed reduction and update go through the whole-call paths: the same bits as without fault tolerance."""
    plain = MPIStrategy(device="cpu", abort_on_error=False, timeout=30, piece_bytes=4096)
    try:
        x = np.linspace(-1.0, 1.0, 5000, dtype=np.float32) * (strategy.rank + 1)
        results = []
        for s in (strategy, plain):
            reduced = s.reduce("mean", x.copy(), compression=compression)
            with s.scope():
                v = Variable(np.zeros(5000, np.float32), name="v", aggregation="mean")
            s.run(lambda s=s, v=v: s.batch_update([(v, x)], compression=compression))
            results.append((np.asarray(reduced), v.component.copy()))
        (reduced, updated), (expected_reduced, expected_updated) = results
        assert reduced.tobytes() == expected_reduced.tobytes()
        assert updated.tobytes() == expected_updated.tobytes()
    finally:
        plain.free()
