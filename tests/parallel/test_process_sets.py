"""Process sets: ``MPIStrategy.split`` and ``Communicator.split`` under mpiexec at 1, 2 and 3 ranks.

A set is the ranks of one colour (here mostly ``rank % 2``: the even and the odd ranks), with
communicators of its own. Expected values are derived from the rank and the size; every rank of
the job makes the same calls of the parent in the same order, and every rank of a set the same
calls of its set.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import DEVICES, assert_close, assert_equal, host
from mpidist import CollectiveMismatchError, CommError, MPIStrategy, PerReplica

pytestmark = pytest.mark.mpi

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def members(color_of=lambda r: r % 2, rank=RANK):
    """The world ranks in the set of ``rank``, in order."""
    return [r for r in range(SIZE) if color_of(r) == color_of(rank)]


@pytest.fixture(scope="module", params=DEVICES)
def world(request):
    s = MPIStrategy(device=request.param)
    yield s
    s.free()


@pytest.fixture
def halves(world):
    """The even and the odd ranks, each a process set of ``world``."""
    s = world.split(world.rank % 2)
    yield s
    s.free()


def test_a_set_holds_the_ranks_of_its_colour_with_communicators_of_its_own(world, halves):
    mine = members()
    assert halves.num_replicas_in_sync == len(mine) and halves.rank == mine.index(RANK)
    assert halves.comm.size == len(mine) and halves.communicator.size == len(mine)
    assert halves.backend is world.backend  # the same arrays, the same GPU
    expected = MPI.CONGRUENT if len(mine) == SIZE else MPI.UNEQUAL
    assert MPI.Comm.Compare(halves.comm, world.comm) == expected
    assert MPI.Comm.Compare(halves.comm, halves.communicator.mpi_comm) == MPI.CONGRUENT  # a duplicate: yours
    assert halves.comm != halves.communicator.mpi_comm
    assert re.fullmatch(
        rf"<MPIStrategy #\d+: rank {halves.rank} of {len(mine)}, .*, a process set of #\d+>", repr(halves)
    )
    for _ in range(2):  # twice: nothing lazily created goes wrong the second time
        total = halves.reduce("sum", PerReplica({halves.rank: world.backend.xp.asarray(RANK + 1.0)}))
        assert_equal(total, sum(r + 1.0 for r in mine))
        assert_equal(
            halves.gather(world.backend.xp.asarray([RANK] * (RANK + 1))), [r for r in mine for _ in range(r + 1)]
        )
        assert_close(halves.reduce("mean", np.full(3, float(RANK))), np.full(3, float(np.mean(mine))))
        assert_equal(halves.broadcast(np.array([RANK]), root=len(mine) - 1), [mine[-1]])
        halves.barrier()


def test_key_orders_the_ranks_of_a_set(world):
    reverse = world.split(0, key=SIZE - RANK)
    assert reverse.rank == SIZE - 1 - RANK and reverse.num_replicas_in_sync == SIZE
    assert_equal(reverse.gather(np.array([RANK])), list(range(SIZE))[::-1])
    reverse.free()


def test_color_none_joins_no_set(world):
    sets = [world.split(None if RANK == 0 else 7) for _ in range(2)]  # twice, both made by every rank
    for s in sets:
        if RANK == 0:
            assert s is None
        else:
            assert s.num_replicas_in_sync == SIZE - 1 and s.rank == RANK - 1
            assert_equal(s.reduce("sum", np.array(1.0)), SIZE - 1.0)
            s.free()
    sub = world.communicator.split(None if RANK == SIZE - 1 else 0)
    assert (sub is None) == (RANK == SIZE - 1)
    if sub is not None:
        assert_equal(sub.allreduce(np.array([1])), [SIZE - 1])
        sub.free()


@pytest.mark.parametrize("bad", [-1, 1.5, "even", True])
def test_a_bad_colour_on_one_rank_raises_on_every_rank(world, bad):
    color = bad if RANK == 0 else 0
    if RANK == 0:
        with pytest.raises(
            ValueError,
            match=rf"^rank 0: split: color must be a non-negative integer or None, got {re.escape(repr(bad))}",
        ):
            world.split(color)
    else:
        with pytest.raises(CollectiveMismatchError, match=r"could not take part: ValueError: rank 0: split: color"):
            world.split(color)
    assert_equal(world.reduce("sum", np.array(1.0)), float(SIZE))  # the parent goes on


def test_a_bad_key_on_the_last_rank_raises_on_every_rank(world):
    key = "first" if RANK == SIZE - 1 else None
    last = SIZE - 1
    expected = ValueError if last == RANK else CollectiveMismatchError
    pattern = "key must be an integer or None, got 'first'" if last == RANK else "could not take part: ValueError"
    with pytest.raises(expected, match=rf"rank {last}: split: {pattern}" if last == RANK else pattern):
        world.communicator.split(0, key=key)
    assert_equal(world.reduce("sum", np.array(1.0)), float(SIZE))


def test_a_set_scope_nests_in_the_parents_and_the_parents_methods_raise_in_it(world, halves):
    mine, theirs = re.escape(repr(world)), re.escape(repr(halves))
    with world.scope():
        v = md.Variable(np.zeros(2), name="v", aggregation="mean")  # the parent's
        with halves.scope() as s:
            assert s is halves and md.get_strategy() is halves and md.in_cross_replica_context()
            w = md.Variable(np.zeros(2), name="w", aggregation="mean")  # the set's
            assert w.strategy is halves
            halves.run(lambda: w.assign_add(np.full(2, float(RANK))))
            assert_close(w.numpy(), np.full(2, float(np.mean(members()))))
            assert_equal(halves.reduce("sum", np.array(1.0)), float(len(members())))
            for what, call in (
                ("strategy.reduce", lambda: world.reduce("sum", 1.0)),
                ("strategy.gather", lambda: world.gather(np.ones(1))),
                ("strategy.run", lambda: world.run(lambda: None)),
                ("scope()", lambda: world.scope().__enter__()),
                ("assign_add of variable 'v'", lambda: v.assign_add(np.ones(2))),
            ):
                with pytest.raises(
                    RuntimeError, match=rf"^rank {RANK}: {re.escape(what)} \(of {mine}\) .*another strategy, {theirs}"
                ):
                    call()
            with halves.scope():  # nested in itself, too
                assert md.get_strategy() is halves
        assert md.get_strategy() is world  # back in the parent's scope, whose methods work again
        assert_equal(world.reduce("sum", np.array(1.0)), float(SIZE))
        # the set's methods raise in the parent's scope until the set's scope is entered (its rank in the set)
        with pytest.raises(
            RuntimeError, match=rf"^rank {halves.rank}: strategy.reduce \(of {theirs}\) .*another strategy, {mine}"
        ):
            halves.reduce("sum", 1.0)

        def in_replica_context():  # the set's scope inside the parent's run
            with halves.scope():
                return float(halves.reduce("sum", np.array(2.0)))

        result = world.run(in_replica_context)
        assert world.experimental_local_results(result) == (2.0 * len(members()),)
    assert md.get_strategy() is None
    # outside any scope both work
    assert_equal(world.reduce("sum", np.array(1.0)), float(SIZE))
    assert_equal(halves.reduce("sum", np.array(1.0)), float(len(members())))


def test_a_parents_scope_is_not_entered_in_a_sets_and_sets_do_not_mix(world, halves):
    other = world.split(0)  # every rank: a second set, not split from ``halves``
    with halves.scope():
        with pytest.raises(RuntimeError, match=rf"^rank {RANK}: scope\(\) \(of {re.escape(repr(world))}\)"):
            world.scope().__enter__()
        with pytest.raises(RuntimeError, match=rf"^rank {RANK}: scope\(\) \(of {re.escape(repr(other))}\)"):
            other.scope().__enter__()
    nested = halves.split(0)  # a set of a set nests in both
    with world.scope(), halves.scope(), nested.scope():
        assert_equal(nested.reduce("sum", np.array(1.0)), float(len(members())))
    with world.scope(), nested.scope():
        assert md.get_strategy() is nested
    assert md.get_strategy() is None
    nested.free()
    other.free()


def test_a_sets_communicator_works_anywhere(world, halves):
    comm, n = halves.communicator, float(len(members()))
    expected = np.array([n])

    def allreduce():
        return host(comm.allreduce(np.ones(1)))

    assert_equal(allreduce(), expected)  # outside any scope
    with world.scope():
        assert_equal(allreduce(), expected)
        result = world.run(allreduce)
        assert_equal(world.experimental_local_results(result)[0], expected)
    with halves.scope():
        assert_equal(allreduce(), expected)
        assert_equal(halves.experimental_local_results(halves.run(allreduce))[0], expected)
    with world.scope(), halves.scope():
        assert_equal(allreduce(), expected)


def test_sets_never_cross_match_interleaved_with_the_parent(world, halves):
    """The even set makes more collectives than the odd one, and both interleave them with world collectives."""
    mine = members()
    even = RANK % 2 == 0
    sub, top = halves.communicator, world.communicator
    for step in range(4):
        handle = sub.iallreduce(np.full(2, float(RANK + step)))  # in flight across the world's collectives
        for repeat in range(step + 1 if even else 1):
            got = sub.allreduce(np.array([RANK + 1.0, step, repeat]))
            assert_equal(got, [sum(r + 1.0 for r in mine), step * len(mine), repeat * len(mine)])
        assert_equal(top.allreduce(np.array([float(RANK)])), [SIZE * (SIZE - 1) / 2])
        gathered = sub.allgather(np.full(RANK + step, RANK, dtype=np.int32))
        assert_equal(gathered, np.concatenate([np.full(r + step, r, dtype=np.int32) for r in mine]))
        assert_equal(top.allgather(np.array([RANK])), list(range(SIZE)))
        if even:
            sub.barrier()
        assert_equal(handle.wait(), np.full(2, sum(r + step for r in mine), dtype=float))
        assert_equal(world.reduce("sum", np.array(step)), step * SIZE)


def test_sets_of_the_same_strategy_update_their_own_variables(world, halves):
    with halves.scope():
        v = md.Variable(np.zeros(3), aggregation="sum")  # "Variable" in each set: names are per strategy
    assert v.name == "Variable"
    for step in range(3):
        halves.run(lambda step=step: v.assign_add(np.full(3, float(RANK * step))))
        with world.scope():
            world.run(lambda: None)
    assert_close(v.numpy(), np.full(3, sum(r * s for r in members() for s in range(3))))


def test_a_set_inherits_the_parents_options_and_takes_its_own(world):
    parent = MPIStrategy(device="cpu", fusion_bytes=4096, timeout=300)
    s = parent.split(RANK % 2, timeout=100 + RANK % 2)  # each set its own timeout
    assert s.options.fusion_bytes == 4096 and s.options.timeout == 100 + RANK % 2
    assert_equal(s.reduce("sum", np.array(1.0)), float(len(members())))
    s.free()
    parent.free()


def test_the_ranks_of_a_set_agree_on_its_options(world):
    # piece_bytes: 1 MiB on ranks 0 and 1, 2 MiB on ranks 2 and 3: a set of even (odd) ranks with both disagrees
    piece = (1 + RANK // 2) << 20
    disagree = len({(1 + r // 2) for r in members()}) > 1
    if disagree:
        with pytest.raises(CollectiveMismatchError, match=r"ranks disagree on the options of .*piece_bytes"):
            world.split(RANK % 2, piece_bytes=piece)
    else:
        s = world.split(RANK % 2, piece_bytes=piece)
        assert s.options.piece_bytes == piece
        s.free()
    # one set of every rank: it disagrees as soon as it has two
    if SIZE > 1:
        with pytest.raises(CollectiveMismatchError, match=r"ranks disagree on the options of .*check_finite"):
            world.communicator.split(0, check_finite=RANK == 0)
    else:
        sub = world.communicator.split(0, check_finite=True)
        assert sub.options.check_finite
        sub.free()
    assert_equal(world.reduce("sum", np.array(1.0)), float(SIZE))  # the parent goes on


def test_freeing_a_set_and_freeing_the_parent_first(world):
    parent = MPIStrategy(device="cpu")
    s = parent.split(RANK % 2)
    sub = parent.communicator.split(RANK % 2)
    parent.free()  # the sets do not depend on it
    assert_equal(s.reduce("sum", np.array(1.0)), float(len(members())))
    assert_equal(sub.allreduce(np.array([2.0])), [2.0 * len(members())])
    s.free()
    s.free()  # a second call does nothing
    sub.free()
    sub.free()
    with pytest.raises(CommError, match="communicator unusable: the communicator was freed"):
        s.communicator.barrier()
    with pytest.raises(CommError, match="communicator unusable: the communicator was freed"):
        sub.allreduce(np.ones(1))
    assert_equal(world.reduce("sum", np.array(1.0)), float(SIZE))  # other strategies go on
