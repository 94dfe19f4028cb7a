"""The life cycle of handles, communicators and strategies never crashes or hangs (1, 2 and 3 ranks).

A handle dropped before ``wait()`` is held by its communicator, with its arrays, until it
completes: at a later ``wait()``, ``free()`` or exit, whenever each rank's garbage collector
runs; completing a handle makes no collective call, so handles complete in any order; ``free()``
may be called twice; a strategy is freed by reference counting alone. What happens at exit is
checked on whole jobs in ``test_lifecycle_jobs.py``.
"""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import CollectiveMismatchError, CommError, MPIStrategy, Variable, VariableAggregation
from mpidist._comm.communicator import Communicator
from mpidist._options import Options

pytestmark = pytest.mark.mpi

SETTINGS = {"default": {}, "checks-off": {"check_collectives": False, "timeout": None}}
N = 1 << 18  # 2 MiB of float64: sent in the rendezvous protocol, so MPI reads the input while the others arrive


def triangle(n: int) -> float:
    """The sum of rank + 1 over ``n`` ranks."""
    return n * (n + 1) / 2


def scribble() -> None:
    """Collect garbage and overwrite freed memory: an array MPI still used would now hold -7s (or be unmapped)."""
    gc.collect()
    junk = [np.full(N, -7.0) for _ in range(8)]
    del junk


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_dropped_handle_completes_with_its_arrays_at_free(setting):
    c = Communicator(MPI.COMM_WORLD, Options(**SETTINGS[setting]))
    n = c.size
    outs = [np.zeros(N), np.zeros(N)]
    time.sleep(0.2 * c.rank)  # the others are late: MPI reads the temporaries after they were dropped
    for out in outs:
        c.iallreduce(np.full(N, c.rank + 1.0), out=out)  # a temporary, and a handle nobody keeps
    scribble()
    for _ in range(2):  # collectives with the handles in flight (with checks on, their transfers start here)
        assert c.allreduce(np.ones(3)).tolist() == [n] * 3
    scribble()
    c.free()  # completes them, in start order
    for out in outs:
        np.testing.assert_array_equal(out, np.full(N, triangle(n)))


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_kept_handle_keeps_its_temporary_input_alive(setting):
    """The handle alone holds the input: with every check off nothing else does."""
    c = Communicator(MPI.COMM_WORLD, Options(**SETTINGS[setting]))
    time.sleep(0.2 * c.rank)
    handle = c.iallreduce(np.full(N, c.rank + 1.0))
    scribble()
    for _ in range(2):
        np.testing.assert_array_equal(handle.wait(), np.full(N, triangle(c.size)))
    c.free()


def test_never_waited_handles_of_every_kind_complete_at_free():
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024))
    n, r = c.size, c.rank
    reduced, broadcast = np.zeros(5000), np.full(7, float(r))
    c.iallreduce(np.full(5000, r + 1.0), out=reduced)  # several pieces
    c.ibroadcast(broadcast, root=n - 1)
    c.iallgather(np.full(3, r))
    c.iallreduce_many([np.full(4, r + 1.0), np.ones(2, np.float32)])
    scribble()
    c.free()
    np.testing.assert_array_equal(reduced, np.full(5000, triangle(n)))
    np.testing.assert_array_equal(broadcast, np.full(7, n - 1.0))


def test_free_leaves_a_handles_error_with_the_handle():
    """As an executor's shutdown: free() completes what is in flight and raises nothing; wait() raises the error."""
    c = Communicator(MPI.COMM_WORLD, Options())
    if c.size < 2:
        c.free()
        pytest.skip("needs two ranks to disagree")
    handle = c.iallreduce(np.ones(2 + (c.rank == c.size - 1)))  # another shape on the last rank
    c.free()
    for _ in range(2):
        with pytest.raises(CollectiveMismatchError, match="float64\\[3\\]"):
            handle.wait()


def test_dropped_handles_do_not_pile_up():
    c = Communicator(MPI.COMM_WORLD, Options())
    for i in range(200):
        c.iallreduce(np.full(8, float(i)))
    c.barrier()
    assert len(c._transport.handles) < 64  # those whose transfer completed were let go
    c.free()


@pytest.mark.parametrize("node_size", [1, 2])
def test_hierarchical_handles_complete_in_any_order(node_size):
    """Completing a handle makes no collective call: each rank may wait in its own order (here opposite ones)."""
    c = Communicator(MPI.COMM_WORLD, Options(hierarchical=True, node_size=node_size, piece_bytes=1024, timeout=5.0))
    n, r = c.size, c.rank
    handles = [c.iallreduce(np.full(500, (r + 1.0) * (k + 1))) for k in range(3)]
    order = range(3) if r % 2 == 0 else reversed(range(3))
    for k in order:
        np.testing.assert_array_equal(handles[k].wait(), np.full(500, triangle(n) * (k + 1)))
    np.testing.assert_array_equal(c.allreduce(np.full(500, r + 1.0)), np.full(500, triangle(n)))  # blocking: 3 stages
    c.free()


def test_free_twice_does_nothing_the_second_time():
    c = Communicator(MPI.COMM_WORLD, Options())
    c.free()
    c.free()
    with pytest.raises(CommError, match="unusable: the communicator was freed"):
        c.allreduce(np.ones(2))
    s = MPIStrategy(device="cpu")
    s.free()
    s.free()
    with pytest.raises(CommError, match="unusable"):
        s.reduce("sum", np.ones(2))


def test_a_strategy_is_freed_without_the_garbage_collector():
    """No reference cycle holds a strategy, so each rank frees it at the same point of the program."""

    def train() -> weakref.ref:
        s = MPIStrategy(device="cpu")
        with s.scope():
            v = Variable(np.zeros(3), name="v", aggregation=VariableAggregation.MEAN)
        s.run(lambda: v.assign_add(np.ones(3)))
        assert s.reduce("sum", v).tolist() == [s.num_replicas_in_sync] * 3
        return weakref.ref(s)

    gc.collect()
    gc.disable()
    try:
        assert train()() is None
    finally:
        gc.enable()
