"""The ranks agree on what fixes a distributed dataset's order when an epoch starts (1, 2 and 3 ranks).

An ``ArrayDataset`` or ``FileDataset`` whose length, seed, epoch, shuffle,
batch size, sharding or position differs between ranks would silently give
some samples to two ranks and others to none. Instead every rank raises
``CollectiveMismatchError`` at the epoch's first ``next()``, naming what
differs, each rank's value and the ranks. In each test the last rank is the
one that differs (at one rank nothing can differ, and the data comes out
right); every rank makes the same collectives in the same order, and the
assertions follow them.
"""

from __future__ import annotations

import collections
import contextlib
import json

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._distribute.strategy import MPIStrategy
from mpidist._errors import CollectiveMismatchError
from mpidist._input.datasets import ArrayDataset, FileDataset
from mpidist._input.factories import distribute_dataset
from mpidist._input.sharding import epoch_order

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def strategy():
    s = MPIStrategy(timeout=30)
    yield s
    s.free()


def world():
    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def odd(r, n):
    """Whether this rank is the one that differs: the last, when there are several."""
    return n > 1 and r == n - 1


def grouped(n, field, usual, other):
    """How the message names the values: ``field (ranks 0-1: usual; rank 2: other)`` at 3 ranks."""
    others = "rank 0" if n == 2 else f"ranks 0-{n - 2}"
    return f"{field} ({others}: {usual}; rank {n - 1}: {other})"


def samples(strategy, dist):
    """Every rank's samples of one epoch, gathered (one collective per step, the same count on every rank)."""
    return [x for step in dist for x in strategy.gather(np.atleast_1d(step.get())).tolist()]


def _files(per_file=3, count=6):
    contents = {f"part-{i}": [np.array([i, j]) for j in range(per_file)] for i in range(count)}
    return contents, sorted(contents)


def _records(strategy, dist):
    return [tuple(row) for step in dist for row in strategy.gather(step.get().reshape(-1, 2)).tolist()]


# Each case builds this rank's distributed dataset (the last rank's differs), and names the field with the
# value of the other ranks and the last rank's. At one rank, the last rank's value is the only one.
def _seed(strategy, r, n):
    data = ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=5 if odd(r, n) else 4)
    return distribute_dataset(strategy, data), ("seed", 4, 5)


def _set_epoch_on_one_rank(strategy, r, n):
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4))
    if odd(r, n):
        dist.set_epoch(3)
    return dist, ("epoch", 0, 3)


def _length(strategy, r, n):
    data = ArrayDataset(np.arange(31 if odd(r, n) else 30), 2 * n, shuffle=True, seed=4)
    return distribute_dataset(strategy, data), ("num_samples", 30, 31)


def _batch_size(strategy, r, n):
    data = ArrayDataset(np.arange(30), 4 * n if odd(r, n) else 2 * n, shuffle=True, seed=4)
    return distribute_dataset(strategy, data), ("global_batch_size", 2 * n, 4 * n)


def _shuffle(strategy, r, n):
    data = ArrayDataset(np.arange(30), 2 * n, shuffle=odd(r, n), seed=4)
    return distribute_dataset(strategy, data), ("shuffle", 0, 1)


def _sharding(strategy, r, n):
    data = ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4)
    return distribute_dataset(strategy, data, auto_shard=not odd(r, n)), ("sharding", "batch", "off")


def _position(strategy, r, n):
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4))
    state = dict(iter(dist).get_state(), offset=4 * n if odd(r, n) else 2 * n)
    return dist.iterator_from_state(state), ("offset", 2 * n, 4 * n)


def _file_seed(strategy, r, n):
    contents, names = _files()
    files = FileDataset(names, contents.__getitem__, global_batch_size=n, shuffle=True, seed=2 if odd(r, n) else 1)
    return distribute_dataset(strategy, files), ("seed", 1, 2)


def _file_count(strategy, r, n):
    contents, names = _files(count=7 if odd(r, n) else 6)
    files = FileDataset(names, contents.__getitem__, global_batch_size=n, shuffle=True, seed=1)
    return distribute_dataset(strategy, files, shard_policy="element"), ("files", 6, 7)


def _file_seed_by_record(strategy, r, n):
    contents, names = _files()  # no batch size: read by record like any iterable, but its order is the files'
    files = FileDataset(names, contents.__getitem__, shuffle=True, seed=2 if odd(r, n) else 1)
    return distribute_dataset(strategy, files, shard_policy="element"), ("seed", 1, 2)


def _steps_per_transfer(strategy, r, n):
    contents, names = _files()
    files = FileDataset(names, contents.__getitem__, global_batch_size=n)
    return distribute_dataset(strategy, files, steps_per_transfer=3 if odd(r, n) else 2), ("steps_per_transfer", 2, 3)


CASES = [
    _seed,
    _set_epoch_on_one_rank,
    _length,
    _batch_size,
    _shuffle,
    _sharding,
    _position,
    _file_seed,
    _file_count,
    _file_seed_by_record,
    _steps_per_transfer,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_a_difference_raises_on_every_rank_naming_it(strategy, case):
    r, n = world()
    dist, (field, usual, other) = case(strategy, r, n)
    try:
        read = len(list(dist))  # the first next() agrees on the order: the one collective of an array epoch
    except CollectiveMismatchError as error:
        caught = error
    else:
        caught = None
    total = strategy.reduce("sum", np.ones(1), axis=None).tolist()  # every rank left the agreement together
    assert total == [n]
    if n == 1:
        assert caught is None and read > 0
        return
    assert caught is not None
    message = str(caught)
    assert message.startswith(f"rank {r}: the ranks would read this "), message
    assert grouped(n, field, usual, other) in message, message
    assert "call set_epoch on every rank" in message
    assert sorted(caught.records) == list(range(n))
    assert f"{field}={other}" in caught.records[n - 1] and f"{field}={usual}" in caught.records[0]


def test_the_iterator_stays_at_its_position_and_reads_once_the_ranks_agree(strategy):
    """set_epoch on one rank only raises; once every rank reads the same epoch, each sample comes exactly once."""
    r, n = world()
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4, remainder="partial"))
    dist.set_epoch(2 if odd(r, n) else 1)
    it = iter(dist)
    with pytest.raises(CollectiveMismatchError) if n > 1 else contextlib.nullcontext():
        next(it)
    dist.set_epoch(2)  # now on every rank: a new iterator reads epoch 2
    seen = samples(strategy, dist)
    assert it.offset == (0 if n > 1 else 2) and it.epoch == (2 if odd(r, n) else 1)
    assert seen == epoch_order(30, 2, 4).tolist()


@pytest.mark.parametrize("remainder", ["drop", "partial", "mask"])
def test_agreed_array_epochs_deliver_every_sample_exactly_once(strategy, remainder):
    _, n = world()
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(31), 2 * n, shuffle=True, seed=8, remainder=remainder))
    epochs = []
    for epoch in range(3):
        dist.set_epoch(epoch)
        seen = []
        for step in dist:
            rows = step[0].get()[step[1].get()] if remainder == "mask" else step.get()
            seen += strategy.gather(rows).tolist()
        epochs.append(seen)
    for epoch, seen in enumerate(epochs):
        order = epoch_order(31, epoch, 8).tolist()
        if remainder == "drop":
            order = order[: 31 - 31 % (2 * n)]
        assert seen == order  # in the epoch's order, every sample once, none duplicated
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize("policy", ["file", "element"])
def test_agreed_shuffled_files_deliver_every_record_exactly_once(strategy, policy):
    _, n = world()
    contents, names = _files(per_file=3, count=2 * n)
    files = FileDataset(names, contents.__getitem__, global_batch_size=n, shuffle=True, seed=6)
    dist = distribute_dataset(strategy, files, shard_policy=policy)
    epochs = []
    for epoch in range(2):
        dist.set_epoch(epoch)
        epochs.append(_records(strategy, dist))
    everything = [(i, j) for i in range(2 * n) for j in range(3)]
    for seen in epochs:
        assert collections.Counter(seen) == collections.Counter(everything)


def test_a_restored_position_is_agreed_and_reads_the_rest_once(strategy):
    _, n = world()
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4, remainder="partial"))
    it = iter(dist)
    head = [x for _ in range(2) for x in strategy.gather(next(it).get()).tolist()]
    state = json.loads(json.dumps(it.get_state()))  # the same on every rank, as a checkpoint restores it
    rest = samples(strategy, dist.iterator_from_state(state))
    assert head + rest == epoch_order(30, 0, 4).tolist()


def test_a_rank_that_skips_a_step_fails_within_that_step(strategy):
    """The steps drawn are part of every collective's identity: a skipped step is a mismatch in that very step."""
    r, n = world()
    communicator = strategy.communicator
    communicator.agreement.input_steps = 0  # earlier tests drew steps: count this test's
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(40.0), 2 * n, remainder="drop"))
    it = iter(dist)
    strategy.reduce("sum", next(it))  # step 1, on every rank
    if odd(r, n):
        next(it)  # this rank skips step 2: it would reduce step 3's data with the others' step 2
    with pytest.raises(CollectiveMismatchError) if n > 1 else contextlib.nullcontext() as caught:
        strategy.reduce("sum", next(it))
    if n > 1:
        others = "rank 0" if n == 2 else f"ranks 0-{n - 2}"
        assert str(caught.value).endswith(
            f"drew different numbers of steps from their input before collective #{communicator._transport.seq} "
            f"(allreduce(sum) of 'reduce' float64[2]): {others}: 2 steps; rank {n - 1}: 3 steps. Every rank must "
            "call next() on its mpidist input iterators the same number of times (a rank that skipped or repeated "
            "a step would pair its data with another step's); no array was modified."
        ), caught.value
    # the steps drawn stay different, so every later collective of this strategy would fail; settle them
    communicator.agreement.input_steps = 0
    np.testing.assert_array_equal(strategy.reduce("sum", np.ones(2)), [n, n])


def test_an_array_epoch_costs_one_small_allreduce(strategy, monkeypatch):
    """The agreement is the epoch's only collective (none at one rank): one allreduce of 7 float64 values."""
    _, n = world()
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4), prefetch=0)
    communicator = strategy.communicator
    calls = []

    def counted(method, original):
        def call(*args, **kwargs):
            calls.append((method, kwargs.get("name"), args))
            return original(*args, **kwargs)

        return call

    for method in ("allreduce", "allgather", "allgather_bytes", "broadcast", "outcome"):
        monkeypatch.setattr(communicator, method, counted(method, getattr(communicator, method)))
    for epoch in range(2):
        dist.set_epoch(epoch)
        steps = len(list(dist))
    monkeypatch.undo()
    assert steps == 30 // (2 * n)
    assert [(m, name) for m, name, _ in calls] == [("allreduce", "data: epoch start")] * 2 * (n > 1)
    assert all(a[0].dtype == np.float64 and a[0].size <= 8 for _, _, a in calls)


def test_with_check_collectives_off_the_order_is_not_agreed():
    """check_collectives=False: an array epoch is local again (and a difference goes unnoticed, as documented)."""
    r, n = world()
    unchecked = MPIStrategy(check_collectives=False, timeout=30)
    try:
        dist = distribute_dataset(unchecked, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=4 + odd(r, n)))
        steps = len(list(dist))
        total = unchecked.reduce("sum", np.ones(1), axis=None).tolist()
    finally:
        unchecked.free()
    assert steps == 30 // (2 * n) and total == [n]
