"""One error voice: every error class mpidist raises on a rank starts with that rank's prefix.

Under mpiexec (1, 2 and 3 ranks). Each test triggers one class for real (no error is built by
hand) and checks that the message begins with ``on_rank(rank, ...)``'s ``"rank N: "``, on every
rank that raises. Errors that need two ranks to disagree skip at one rank. CollectiveTimeoutError
(and its warning) is checked in test_comm.py's timeout test, RankLeftError (a rank that leaves the
job) by the whole-job runs of test_collective_safety.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from mpidist import (
    CheckpointError,
    ChecksumError,
    CollectiveMismatchError,
    CommError,
    IntegerOverflowError,
    MirrorDivergenceError,
    NonFiniteError,
)
from mpidist._comm.communicator import Communicator
from mpidist._errors import on_rank
from mpidist._options import Options

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD


def assert_prefixed(error: BaseException, rank: int) -> None:
    assert str(error).startswith(on_rank(rank, "")), f"{type(error).__name__} without the rank prefix: {error}"


def needs_two_ranks() -> None:
    if WORLD.size < 2:
        pytest.skip("needs two ranks that disagree")


def test_the_prefix_has_one_form():
    assert on_rank(3, "x") == "rank 3: x"
    assert on_rank(None, "x") == "mpidist: x"


def test_collective_mismatch():
    needs_two_ranks()
    c = Communicator(WORLD, Options.resolve(env={}))
    with pytest.raises(CollectiveMismatchError) as info:
        c.allreduce(np.ones(2 + (c.rank == c.size - 1)))
    assert_prefixed(info.value, c.rank)
    c.free()


def test_non_finite():
    c = Communicator(WORLD, Options.resolve(env={}, check_finite=True))
    data = np.ones(3)
    if c.rank == 0:
        data[1] = np.nan
    with pytest.raises(NonFiniteError) as info:
        c.allreduce(data)
    assert_prefixed(info.value, c.rank)
    c.free()


def test_integer_overflow():
    needs_two_ranks()
    c = Communicator(WORLD, Options.resolve(env={}, check_overflow=True))
    with pytest.raises(IntegerOverflowError) as info:
        c.allreduce(np.full(2, 127, np.int8), op="sum")
    assert_prefixed(info.value, c.rank)
    c.free()


def test_communicator_unusable():
    c = Communicator(WORLD, Options.resolve(env={}))
    c.free()
    with pytest.raises(CommError) as info:
        c.allreduce(np.ones(2))
    assert_prefixed(info.value, WORLD.rank)


def test_mirror_divergence():
    needs_two_ranks()
    strategy = md.MPIStrategy()
    with strategy.scope():
        v = md.Variable(np.ones(3), name="diverged")
        if strategy.rank == strategy.num_replicas_in_sync - 1:
            v.component[0] += 1.0
        with pytest.raises(MirrorDivergenceError) as info:
            strategy.check_mirrored([v])
    assert_prefixed(info.value, strategy.rank)
    strategy.free()


@pytest.fixture
def shared_dir(shared_tmp):
    """The checkpoint directory, inside a fresh directory every rank sees (``shared_tmp``)."""
    return shared_tmp / "ckpt"


def test_checkpoint_errors(shared_dir):
    strategy = md.MPIStrategy()
    with strategy.scope():
        v = md.Variable(np.arange(64.0), name="weights")
        with pytest.raises(FileNotFoundError) as missing:  # a built-in type: every rank still says which it is
            md.Checkpoint(weights=v).restore(shared_dir / "never-saved")
        assert_prefixed(missing.value, strategy.rank)
        foreign = shared_dir.parent / "foreign"
        if strategy.rank == 0:
            foreign.mkdir()
            (foreign / "notes.txt").write_text("not a checkpoint")
        WORLD.Barrier()
        with pytest.raises(CheckpointError) as info:
            md.Checkpoint(weights=v).save(foreign)
        assert_prefixed(info.value, strategy.rank)
        md.Checkpoint(weights=v).save(shared_dir, block_bytes=64)
        WORLD.Barrier()
        if strategy.rank == 0:  # damage one block of the saved weights
            path = next(shared_dir.glob("ckpt-*/*weights.npy"))
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x40
            path.write_bytes(bytes(data))
        WORLD.Barrier()
        with pytest.raises(ChecksumError) as info:
            md.Checkpoint(weights=v).restore(shared_dir)
        assert_prefixed(info.value, strategy.rank)
    strategy.free()
