"""The input pipeline under mpiexec (1, 2 and 3 ranks): contract C7 and what builds on it.

Expected values are derived from rank and size, so each test holds at any
world size. Every rank makes the same collective calls in the same order;
assertions come after the collectives of a test. Datasets are small: the
whole file runs in seconds at 3 ranks on 2 cores.
"""

from __future__ import annotations

import collections
import fractions
import json
import logging
import os
import re
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._comm.communicator import Communicator
from mpidist._distribute.metrics import Accuracy, Mean, Sum
from mpidist._distribute.strategy import MPIStrategy
from mpidist._errors import CollectiveTimeoutError
from mpidist._input import distributed
from mpidist._input.datasets import ArrayDataset, FileDataset, InputContext
from mpidist._input.factories import distribute_dataset, distribute_datasets_from_function
from mpidist._input.multistep import MultiStepContext
from mpidist._input.sharding import batch_plan, epoch_order, num_steps
from mpidist._values.values import PerReplica

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def strategy():
    s = MPIStrategy(timeout=30)
    yield s
    s.free()


def world():
    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


class NoLen:
    """An iterable without len(): distribute_dataset must agree on its end collectively."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def generator(n):
    yield from range(n)


def values(steps):
    return [int(e.get()) for e in steps]


# -- 1. element sharding ------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [range, lambda n: list(range(n)), generator, NoLen, np.arange],
    ids=["range", "list", "generator", "nolen", "ndarray"],
)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_auto_shard_gives_element_s_times_n_plus_r(strategy, make, prefetch):
    r, n = world()
    steps = list(distribute_dataset(strategy, make(11), prefetch=prefetch))
    gathered = [strategy.gather(e).tolist() for e in steps]  # collective, the same count everywhere
    assert all(isinstance(e, PerReplica) for e in steps)
    assert values(steps) == [s * n + r for s in range(11 // n)]
    assert gathered == [list(range(s * n, s * n + n)) for s in range(11 // n)]
    if n == 2:
        assert gathered == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_without_auto_shard_every_rank_sees_every_element(strategy):
    data = [(i, {"square": i * i, "name": f"e{i}"}) for i in range(11)]
    dist = distribute_dataset(strategy, data, auto_shard=False)
    steps = list(dist)
    assert len(dist) == len(steps) == 11
    first, extra = steps[3]
    assert isinstance(first, PerReplica) and isinstance(extra["square"], PerReplica)
    assert extra["name"].get() == "e3"  # strings are passed as they are
    result = strategy.run(lambda i, d: i + d["square"], args=steps[3])
    assert int(result.get()) == 12
    assert [int(i.get()) for i, _ in steps] == list(range(11))


def test_each_iter_starts_over_and_len(strategy):
    _, n = world()
    dist = distribute_dataset(strategy, range(11))
    assert len(dist) == 11 // n
    assert values(dist) == values(dist)
    with pytest.raises(TypeError, match="only known by iterating"):
        len(distribute_dataset(strategy, NoLen(11)))


def test_a_one_shot_iterator_is_read_once_and_then_says_so(strategy):
    _, n = world()
    dist = distribute_dataset(strategy, generator(4 * n))
    it = iter(dist)
    assert len(list(it)) == 4
    with pytest.raises(StopIteration):  # stays exhausted, without communicating
        next(it)
    with pytest.raises(RuntimeError, match=r"one-shot iterator .generator. that was already read"):
        next(iter(dist))


def test_close_mid_epoch_then_read_on_from_the_position(strategy):
    _, n = world()
    for data in (NoLen(9 * n), ArrayDataset(np.arange(9 * n), n, shuffle=True)):
        dist = distribute_dataset(strategy, data, prefetch=3)
        reference = values(dist) if isinstance(data, NoLen) else [int(e.get()[0]) for e in dist]
        it = iter(dist)
        head = [next(it), next(it)]
        it.close()
        rest = list(it)
        got = values(head + rest) if isinstance(data, NoLen) else [int(e.get()[0]) for e in head + rest]
        assert got == reference and len(got) == 9


@pytest.mark.parametrize("with_len", [True, False])
def test_from_function_runs_the_shortest_ranks_number_of_steps(strategy, with_len):
    r, n = world()
    seen = []

    def dataset_fn(ctx: InputContext):
        seen.append((ctx.input_pipeline_id, ctx.num_input_pipelines, ctx.num_replicas_in_sync))
        length = 5 + 2 * ctx.input_pipeline_id  # rank 0 has the fewest elements
        data = [100 * ctx.input_pipeline_id + i for i in range(length)]
        return data if with_len else iter(data)

    dist = distribute_datasets_from_function(strategy, dataset_fn, prefetch=1)
    assert dist.shard_policy == "function"
    assert values(dist) == [100 * r + i for i in range(5)]
    assert seen == [(r, n, n)]


def test_per_replica_batch_size_error_names_the_values(strategy):
    r, n = world()
    contexts = []
    distribute_datasets_from_function(strategy, lambda ctx: contexts.append(ctx) or [])
    ctx = contexts[0]
    if 10 % n:
        with pytest.raises(ValueError) as info:
            ctx.get_per_replica_batch_size(10)
        assert "10" in str(info.value) and f"{n} replicas" in str(info.value) and f"rank {r}" in str(info.value)
        with pytest.raises(ValueError, match=f"global batch size 10 is not divisible by the {n} replicas"):
            distribute_dataset(strategy, ArrayDataset(np.zeros(30), 10))
    else:
        assert ctx.get_per_replica_batch_size(10) == 10 // n


# -- 2. array datasets with a global batch size ---------------------------------------------------


def test_array_dataset_splits_each_global_batch_and_shuffles_by_epoch(strategy):
    r, n = world()
    num, batch = 23, 6
    per = batch // n
    data = {"x": np.arange(num, dtype=np.float32)[:, None] * [1, 2], "y": np.arange(num)}
    dist = distribute_dataset(strategy, ArrayDataset(data, batch, shuffle=True, seed=11))
    assert dist.shard_policy == "batch" and len(dist) == num // batch
    epochs = []
    for epoch in (0, 1):  # every collective first, the assertions after
        dist.set_epoch(epoch)
        steps = list(dist)
        epochs.append((epoch_order(num, epoch, 11), steps, [strategy.gather(e["y"]).tolist() for e in steps]))
    for order, steps, gathered in epochs:
        assert len(steps) == num // batch
        for s, e in enumerate(steps):
            mine = e["y"].get()
            assert isinstance(mine, strategy.backend.xp.ndarray) and mine.shape == (per,)
            assert mine.tolist() == order[s * batch + r * per : s * batch + (r + 1) * per].tolist()
            assert np.array_equal(e["x"].get()[:, 1], 2 * mine)
        assert gathered == [order[s * batch : (s + 1) * batch].tolist() for s in range(num // batch)]
    assert not np.array_equal(epochs[0][0], epochs[1][0])
    later = distribute_dataset(strategy, ArrayDataset(data, batch, shuffle=True, seed=11, epoch=1))
    assert later.epoch == 1 and [e["y"].get().tolist() for e in later] == [e["y"].get().tolist() for e in dist]


def test_array_dataset_without_auto_shard_gives_every_rank_the_whole_batch(strategy):
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(10), 4), auto_shard=False)
    assert [e.get().tolist() for e in dist] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- 3. uneven ends ----------------------------------------------------------------------


@pytest.mark.parametrize("remainder", ["drop", "partial", "mask"])
@pytest.mark.parametrize("num", [19, 23])
def test_uneven_end_drop_or_keep_every_sample_once(strategy, remainder, num):
    _, n = world()
    batch = 6
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(num), batch, shuffle=True, seed=3, remainder=remainder))
    seen, shapes = [], []
    for element in dist:
        if remainder == "mask":
            rows, mask = element[0].get(), element[1].get()
            shapes.append(rows.shape)
            rows = rows[mask]
        else:
            rows = element.get()
        seen.extend(strategy.gather(rows).tolist())
    if remainder == "drop":
        kept = num - num % batch
        assert sorted(seen) == sorted(epoch_order(num, 0, 3)[:kept].tolist())
    else:
        assert sorted(seen) == list(range(num))  # every sample exactly once, none duplicated
    if remainder == "mask":
        assert set(shapes) == {(batch // n,)}


def _model(num_classes=4, features=8):
    rng = np.random.default_rng(1234)
    return rng.standard_normal((features, num_classes)).astype(np.float32)


def _per_sample(x, weights):
    """Logits and losses row by row, so a row's result does not depend on its batch."""
    logits = np.array([row @ weights for row in x], dtype=np.float64).reshape(len(x), weights.shape[1])
    return logits


def _losses(logits, y):
    top = logits.max(axis=1, keepdims=True) if len(logits) else logits
    lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0] if len(logits) else np.zeros(0)
    return lse - logits[np.arange(len(y)), y] if len(logits) else np.zeros(0)


def _evaluate(strategy, data, remainder):
    weights = _model()
    with strategy.scope():
        loss, accuracy, total = Mean(), Accuracy(), Sum()

    def step(batch):
        if remainder == "mask":
            (x, y), mask = batch
        else:
            (x, y), mask = batch, None
        logits = _per_sample(x, weights)
        losses = _losses(logits, y)
        loss.update_state(losses, sample_weight=mask)
        accuracy.update_state(y, logits, sample_weight=mask)
        total.update_state(losses, sample_weight=mask)

    for batch in distribute_dataset(strategy, ArrayDataset(data, 6, shuffle=True, seed=9, remainder=remainder)):
        strategy.run(step, args=(batch,))
    return loss.result(), accuracy.result(), total.result()


@pytest.mark.parametrize("remainder", ["partial", "mask"])
@pytest.mark.parametrize("num", [19, 23])
def test_exact_evaluation_is_identical_at_any_number_of_ranks(strategy, remainder, num):
    rng = np.random.default_rng(num)
    data = (rng.standard_normal((num, 8)).astype(np.float32), rng.integers(0, 4, num))
    distributed = _evaluate(strategy, data, remainder)
    alone = MPIStrategy(comm=MPI.COMM_SELF)
    try:
        single = _evaluate(alone, data, remainder)
    finally:
        alone.free()
    logits = _per_sample(data[0], _model())
    losses = _losses(logits, data[1])
    exact_total = sum(fractions.Fraction(v) for v in losses.tolist())
    correct = int((logits.argmax(axis=1) == data[1]).sum())
    reference = (float(exact_total / num), float(fractions.Fraction(correct, num)), float(exact_total))
    assert distributed == single == reference  # bit for bit, at 1, 2 or 3 ranks


# -- 4. files -----------------------------------------------------------------------------


def _files(count):
    contents = {f"part-{i:02d}": [(i, j) for j in range(3 + i % 2)] for i in range(count)}
    return contents, FileDataset(sorted(contents), contents.__getitem__)


def test_files_shard_by_file_when_every_rank_gets_one(strategy, caplog):
    r, n = world()
    contents, files = _files(5)
    with caplog.at_level(logging.INFO, logger="mpidist.data"):
        dist = distribute_dataset(strategy, files)
        got = [tuple(int(v.get()) for v in e) for e in dist]
        list(dist)  # iterating again reports nothing new
    assert dist.shard_policy == "file"
    chains = [[x for i in range(rank, 5, n) for x in contents[f"part-{i:02d}"]] for rank in range(n)]
    steps = min(len(c) for c in chains)  # every rank runs the shortest rank's number of steps
    assert got == chains[r][:steps]
    records = [rec for rec in caplog.records if rec.name == "mpidist.data"]
    if r == 0:
        assert len(records) == 1 and "sharding by file" in records[0].getMessage()
    else:
        assert records == []


def _drop_warnings(record):
    return [str(w.message) for w in record if "dropped" in str(w.message)]


def test_files_of_unequal_shares_warn_with_the_number_dropped(strategy):
    r, n = world()
    contents = {f"f{i}": [(i, j) for j in range(4)] for i in range(10)}  # 10 files of 4 records
    files = FileDataset(sorted(contents), contents.__getitem__)
    shares = [4 * len(range(rank, 10, n)) for rank in range(n)]  # at 3 ranks: 16, 12, 12
    dropped = sum(shares) - n * min(shares)
    for drop_remainder in (None, True):
        dist = distribute_dataset(strategy, files, drop_remainder=drop_remainder)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            first = [tuple(int(v.get()) for v in e) for e in dist]
            second = [tuple(int(v.get()) for v in e) for e in dist]  # once per dataset
        assert first == second and len(first) == min(shares)
        messages = _drop_warnings(record)
        if dropped and drop_remainder is None:
            assert len(messages) == 1, messages
            here = shares[r] - min(shares)  # at 3 ranks: rank 0's file 9
            assert f"rank {r}: mpidist dropped {dropped} element(s) of epoch 0 ({here} on this rank)" in messages[0]
            assert "file sharding" in messages[0] and "drop_remainder=True" in messages[0]
        else:
            assert messages == []


@pytest.mark.parametrize("make", [lambda k: list(range(k)), NoLen])
def test_element_streams_warn_with_the_number_dropped(strategy, make):
    r, n = world()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = [int(x.get()) for x in distribute_dataset(strategy, make(3 * n + 2))]
        quiet = [int(x.get()) for x in distribute_dataset(strategy, make(3 * n + 2), drop_remainder=True)]
        from_fn = distribute_datasets_from_function(strategy, lambda ctx: make(4 + ctx.input_pipeline_id))
        fn = [int(x.get()) for x in from_fn]
    assert got == quiet == [s * n + r for s in range((3 * n + 2) // n)]
    assert fn == [0, 1, 2, 3]
    messages = _drop_warnings(record)
    expected = []
    if (3 * n + 2) % n:  # the last, incomplete group: element 3n + r would have been rank r's
        expected.append(f"dropped {(3 * n + 2) % n} element(s) of epoch 0 ({int(r < (3 * n + 2) % n)} on this rank)")
    if n > 1:  # dataset_fn: rank q read q more
        expected.append(f"dropped {sum(range(n))} element(s) of epoch 0 ({r} on this rank)")
    assert len(messages) == len(expected), messages
    for message, text in zip(messages, expected):
        assert text in message and message.startswith(f"rank {r}: ")


def test_the_drop_warning_names_the_users_line(strategy):
    """The line of the loop that ended the epoch, not mpidist's own file: a for loop, list(),
    ``run_steps_on_dataset``; a global position (elements) and a rank-local one (files)."""
    _, n = world()
    if n == 1:
        pytest.skip("one rank drops nothing")
    contents = {f"f{i}": [i] for i in range(n + 1)}  # rank 0 reads one file more than the others

    def loop():
        for _ in distribute_dataset(strategy, range(n + 1)):
            pass
        return this_line() - 2

    def listed():
        list(distribute_dataset(strategy, FileDataset(sorted(contents), contents.__getitem__)))
        return this_line() - 1

    def steps():
        it = iter(distribute_dataset(strategy, range(2 * n + 1)))
        while strategy.run_steps_on_dataset(lambda ctx, x: None, it, 2).steps_run == 2:
            pass
        return this_line() - 2

    for run in (loop, listed, steps):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            line = run()
        warned = [(w.filename, w.lineno) for w in record if "dropped" in str(w.message)]
        assert warned == [(__file__, line)], (run.__name__, warned)


def this_line() -> int:
    """The line number of the caller's current line."""
    return sys._getframe(1).f_lineno


def test_drop_remainder_choices_are_checked(strategy):
    with pytest.raises(ValueError, match="remainder='partial' or 'mask'"):
        distribute_dataset(strategy, range(5), drop_remainder=False)
    with pytest.raises(ValueError, match="its own remainder="):
        distribute_dataset(strategy, ArrayDataset(np.arange(4), 2), drop_remainder=True)


@pytest.mark.parametrize("policy", ["auto", "element"])
def test_files_shard_by_element_when_too_few_files(strategy, policy):
    r, n = world()
    count = max(1, n - 1) if policy == "auto" else 5
    contents, files = _files(count)
    dist = distribute_dataset(strategy, files, shard_policy=policy)
    got = [tuple(int(v.get()) for v in e) for e in dist]
    stream = [x for name in sorted(contents) for x in contents[name]]
    expected_policy = "file" if policy == "auto" and count >= n else "element"
    assert dist.shard_policy == expected_policy
    if expected_policy == "element":
        assert got == [stream[s * n + r] for s in range(len(stream) // n)]
    if count < n:
        with pytest.raises(ValueError, match=f"{count} files for {n} ranks"):
            distribute_dataset(strategy, files, shard_policy="file")


# -- 4b. batched files: exact by default --------------------------------------------------


def _ten_files_of_four():
    contents = {f"f{i}": [np.array([i, j]) for j in range(4)] for i in range(10)}
    return contents, sorted(contents)


def _real_rows(element, remainder):
    """The records of one step's batch on this rank, as (file, record) pairs: padding rows left out."""
    batch = element[0].get()[element[1].get()] if remainder == "mask" else element.get()
    return [tuple(int(v) for v in row) for row in batch.reshape(-1, 2)]


@pytest.mark.parametrize("remainder", ["partial", "mask"])
@pytest.mark.parametrize("per_rank", [1, 3])
@pytest.mark.parametrize("prefetch,steps_per_transfer", [(0, 1), (2, 3)])
def test_batched_files_visit_every_record_once_in_equal_steps(
    strategy, remainder, per_rank, prefetch, steps_per_transfer
):
    r, n = world()
    contents, names = _ten_files_of_four()  # at 3 ranks: 16, 12 and 12 records
    files = FileDataset(names, contents.__getitem__, global_batch_size=per_rank * n, remainder=remainder)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dist = distribute_dataset(strategy, files, prefetch=prefetch, steps_per_transfer=steps_per_transfer)
        steps = list(dist)
    seen = [row for e in steps for row in _real_rows(e, remainder)]
    widths = [len(e[1].get()) if remainder == "mask" else len(e.get()) for e in steps]
    everyone = MPI.COMM_WORLD.allgather((len(steps), seen))  # collective, after the iteration
    shares = [4 * len(range(rank, 10, n)) for rank in range(n)]
    assert dist.shard_policy == "file"
    assert {count for count, _ in everyone} == {max(-(-share // per_rank) for share in shares)}
    assert sorted(row for _, rows in everyone for row in rows) == [(i, j) for i in range(10) for j in range(4)]
    assert seen == [(i, j) for i in range(r, 10, n) for j in range(4)]  # this rank's files, in order
    if remainder == "mask":
        assert set(widths) == {per_rank}
    else:
        full, last = divmod(shares[r], per_rank)
        assert widths == [per_rank] * full + [last] * (last > 0) + [0] * (len(steps) - full - (last > 0))
    assert _drop_warnings(record) == []


@pytest.mark.parametrize("remainder", ["partial", "mask", "drop"])
def test_batched_files_by_record_split_each_global_batch(strategy, remainder):
    r, n = world()
    contents, names = _ten_files_of_four()
    files = FileDataset(names, contents.__getitem__, global_batch_size=3 * n, remainder=remainder)
    dist = distribute_dataset(strategy, files, shard_policy="element")
    steps = list(dist)
    seen = [row for e in steps for row in _real_rows(e, "mask" if remainder == "mask" else "partial")]
    everyone = MPI.COMM_WORLD.allgather((len(steps), seen))
    stream = [(i, j) for i in range(10) for j in range(4)]
    kept = stream if remainder != "drop" else stream[: len(stream) // (3 * n) * 3 * n]
    assert dist.shard_policy == "element"
    assert {count for count, _ in everyone} == {num_steps(40, 3 * n, 0, remainder)}
    assert sorted(row for _, rows in everyone for row in rows) == sorted(kept)
    assert seen == [row for lo, hi, _ in batch_plan(40, 3 * n, r, n, remainder=remainder) for row in stream[lo:hi]]


def test_batched_files_drop_when_asked_without_a_warning(strategy):
    r, n = world()
    contents, names = _ten_files_of_four()
    files = FileDataset(names, contents.__getitem__, global_batch_size=3 * n, remainder="drop")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        steps = list(distribute_dataset(strategy, files))
    everyone = MPI.COMM_WORLD.allgather(len(steps))
    shares = [4 * len(range(rank, 10, n)) for rank in range(n)]
    assert everyone == [min(share // 3 for share in shares)] * n
    assert [_real_rows(e, "partial") for e in steps] == [
        [(i, j) for i in range(r, 10, n) for j in range(4)][3 * s : 3 * s + 3] for s in range(len(steps))
    ]
    assert _drop_warnings(record) == []
    with pytest.raises(ValueError, match="its own remainder="):
        distribute_dataset(strategy, files, drop_remainder=True)


def test_batched_files_resume_at_the_same_number_of_ranks(strategy):
    contents, names = _ten_files_of_four()
    dist = distribute_dataset(strategy, FileDataset(names, contents.__getitem__, global_batch_size=MPI.COMM_WORLD.size))
    it = iter(dist)
    first = [_real_rows(next(it), "partial") for _ in range(5)]
    state = json.loads(json.dumps(it.get_state()))
    rest = [_real_rows(e, "partial") for e in dist.iterator_from_state(state)]
    assert state["kind"] == "file batches" and state["global_batch_size"] == MPI.COMM_WORLD.size
    assert first + rest == [_real_rows(e, "partial") for e in dist]


@pytest.mark.parametrize(
    ("policy", "batch"), [("file", None), ("file", "n"), ("element", None), ("element", "n")], ids=str
)
def test_a_files_state_restores_only_into_files_read_in_the_same_order(strategy, policy, batch):
    contents, names = _ten_files_of_four()
    size = MPI.COMM_WORLD.size if batch else None

    def files(count=10, **order):
        data = FileDataset(names[:count], contents.__getitem__, global_batch_size=size, **order)
        return distribute_dataset(strategy, data, shard_policy=policy)

    state = json.loads(json.dumps(iter(files(shuffle=True, seed=5)).get_state()))
    assert (state["files"], state["shuffle"], state["seed"]) == (10, 1, 5)
    files(shuffle=True, seed=5).iterator_from_state(state)
    # its position counts records in the saved order: in another one, some would be read twice, others never
    kind = state["kind"]
    with pytest.raises(ValueError, match=f"saved for another order of this '{kind}' dataset: shuffle 1 \\(here 0\\);"):
        files(seed=5).iterator_from_state(state)
    with pytest.raises(ValueError, match=f"saved for another order of this '{kind}' dataset: files 10 \\(here 9\\);"):
        files(count=9, shuffle=True, seed=5).iterator_from_state(state)
    old = {k: v for k, v in state.items() if k not in ("files", "shuffle")}  # saved before the order was recorded
    files(seed=7).iterator_from_state(dict(old, seed=0))


def test_batched_files_need_a_record_on_every_rank(strategy):
    r, n = world()
    contents = {f"f{i}": [] if i == n - 1 else [np.array([i, 0])] for i in range(n)}  # the last rank's file is empty
    files = FileDataset(sorted(contents), contents.__getitem__, global_batch_size=n)
    if n == 1:
        assert list(distribute_dataset(strategy, files)) == []
        return
    with pytest.raises(RuntimeError, match=f"rank {r}: no record was read on rank {n - 1} in epoch 0"):
        list(distribute_dataset(strategy, files))


# -- 5. prefetch --------------------------------------------------------------------------


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "mpidist-prefetch"]


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("steps_per_transfer", [1, 2, 5])
def test_prefetch_and_chunks_do_not_change_the_data(strategy, prefetch, steps_per_transfer):
    data = (np.arange(29.0)[:, None] * [1, -1], np.arange(29))
    opts = dict(prefetch=prefetch, steps_per_transfer=steps_per_transfer)
    arrays = ArrayDataset(data, 6, shuffle=True, seed=2, remainder="partial")
    reference = [e[1].get().tolist() for e in distribute_dataset(strategy, arrays, prefetch=0)]
    assert [e[1].get().tolist() for e in distribute_dataset(strategy, arrays, **opts)] == reference
    assert values(distribute_dataset(strategy, NoLen(17), **opts)) == values(distribute_dataset(strategy, range(17)))


def test_prefetch_runs_ahead_in_a_thread_and_stops(strategy):
    _, n = world()
    pulled = []

    def source():
        for i in range(40 * n):
            pulled.append(i)
            yield i

    it = iter(distribute_dataset(strategy, source(), prefetch=3))
    next(it)
    deadline = time.monotonic() + 5
    while len(pulled) < 4 * n and time.monotonic() < deadline:  # up to 1 + 3 chunks ahead
        time.sleep(0.01)
    ahead = len(pulled)
    alive = len(_prefetch_threads())
    rest = list(it)
    assert ahead >= 4 * n - (n - 1) and alive >= 1
    assert len(rest) == 39
    deadline = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _prefetch_threads() == []


def test_an_error_in_the_source_reaches_every_rank_at_the_same_step(strategy):
    _, n = world()

    def failing():
        yield from range(2 * n)
        raise KeyError("broken record")

    it = iter(distribute_dataset(strategy, failing(), prefetch=2))
    assert len([next(it), next(it)]) == 2
    with pytest.raises(KeyError, match="broken record"):
        next(it)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt, SystemExit])
def test_an_error_on_one_rank_stops_every_rank(strategy, error, prefetch):
    """A source without len() that fails on the last rank only: the others raise instead of waiting,
    also when what it raises is an interrupt (which the failing rank raises as it is)."""
    r, n = world()

    def source():
        yield from range(2 * n)
        if r == n - 1:
            raise error("disk gone")
        yield from range(2 * n, 10 * n)

    it = iter(distribute_dataset(strategy, source(), prefetch=prefetch))
    assert values([next(it), next(it)]) == [r, n + r]
    if r == n - 1:
        with pytest.raises(error, match="disk gone"):
            next(it)
    else:
        failed = f"the input pipeline failed elsewhere in epoch 0 .*rank {n - 1}: {error.__name__}: disk gone"
        with pytest.raises(RuntimeError, match=failed):
            next(it)
    assert values(distribute_dataset(strategy, NoLen(2 * n))) == [r, n + r]  # no collective left behind


def test_every_failed_rank_is_named_and_the_iterators_go_on_agreeing(strategy):
    """Ranks 1..N-1 fail at the same step: rank 0 names all of them; every rank's next iterator works."""
    r, n = world()
    if n == 1:
        pytest.skip("needs a rank whose input does not fail")

    def source():
        yield from range(n)
        if r > 0:
            raise OSError(f"disk {r} gone")
        yield from range(n, 4 * n)

    it = iter(distribute_dataset(strategy, source(), prefetch=0))
    assert values([next(it)]) == [r]
    if r > 0:
        with pytest.raises(OSError, match=f"disk {r} gone"):
            next(it)
    else:
        named = "; ".join(f"rank {q}: OSError: disk {q} gone" for q in range(1, n))
        expected = f"(offset {n}, reading): {named}. Each of those ranks"
        with pytest.raises(RuntimeError, match=re.escape(expected)) as info:
            next(it)
        assert str(info.value).startswith("rank 0: the input pipeline failed elsewhere in epoch 0")
    assert values(distribute_dataset(strategy, NoLen(2 * n))) == [r, n + r]  # no collective left behind


@pytest.fixture
def short_strategy():
    """A strategy with a 20 s deadline: a rank left waiting for another would fail the test in 20 s, not 600."""
    s = MPIStrategy(timeout=20)
    yield s
    s.free()


def _read_ints(path):
    """A FileDataset reader: one int per line of a text file."""
    with open(path) as f:
        for line in f:
            yield int(line)


def _write_files(directory, lines):
    """Rank 0 writes ``lines[i]`` as the file ``part-i.txt`` of ``directory``; every rank gets the paths."""
    paths = [str(directory / f"part-{i}.txt") for i in range(len(lines))]
    if MPI.COMM_WORLD.rank == 0:
        for path, text in zip(paths, lines):
            Path(path).write_text(text)
    MPI.COMM_WORLD.Barrier()
    return paths


def _resumed_files_of_which_the_last_rank_lost_its_file(strategy, directory):
    """Batched files resumed mid-epoch, the last rank's file gone: its source fails when it opens at the position."""
    r, n = world()
    paths = _write_files(directory, ["".join(f"{10 * i + j}\n" for j in range(3)) for i in range(n)])
    dist = distribute_dataset(strategy, FileDataset(paths, _read_ints, global_batch_size=n))
    it = iter(dist)
    assert next(it).get().tolist() == [10 * r]
    state = it.get_state()
    it.close()
    if r == n - 1:
        os.remove(paths[-1])
    return lambda: next(dist.iterator_from_state(state)), FileNotFoundError, f"part-{n - 1}.txt"


def _dataset_fn_that_raises_on_the_last_rank(strategy, directory):
    """``dataset_fn`` raises on the last rank: every rank hears of it when an iterator starts."""
    _, n = world()

    def dataset_fn(ctx):
        if ctx.input_pipeline_id == n - 1:
            raise OSError("no shard for this rank")
        return list(range(4))

    dist = distribute_datasets_from_function(strategy, dataset_fn)
    return lambda: list(dist), OSError, "no shard for this rank"


class _Shard:
    """A rank's data with a len() (so the ranks agree on the length at once); ``set_epoch`` opens the epoch's files."""

    def __init__(self, readable):
        self.readable = readable

    def __len__(self):
        return 4

    def __iter__(self):
        return iter(range(4))

    def set_epoch(self, epoch):
        if not self.readable:
            raise PermissionError(f"shard of epoch {epoch} not readable")


def _dataset_fn_whose_data_cannot_be_opened_on_the_last_rank(strategy, directory):
    """The lengths agree, then the last rank's data fails to open: no chunk follows for the others to agree on."""
    _, n = world()
    dist = distribute_datasets_from_function(strategy, lambda ctx: _Shard(ctx.input_pipeline_id < n - 1))
    return lambda: list(dist), PermissionError, "shard of epoch 0 not readable"


def _files_whose_last_rank_fails_past_the_last_step(strategy, directory):
    """By file, the last rank holds one record more, then a bad line: it fails while counting what it drops."""
    _, n = world()
    lines = ["0\n1\n2\n"] * (n - 1) + ["0\n1\n2\n3\nbad\n"]
    dist = distribute_dataset(strategy, FileDataset(_write_files(directory, lines), _read_ints), prefetch=0)
    return lambda: list(dist), ValueError, "invalid literal for int"


@pytest.mark.parametrize(
    "case",
    [
        _resumed_files_of_which_the_last_rank_lost_its_file,
        _dataset_fn_that_raises_on_the_last_rank,
        _dataset_fn_whose_data_cannot_be_opened_on_the_last_rank,
        _files_whose_last_rank_fails_past_the_last_step,
    ],
    ids=["resumed-file-missing", "dataset-fn-raises", "dataset-fn-data-unopenable", "failing-past-the-last-step"],
)
def test_a_source_failing_on_the_last_rank_stops_every_rank_at_once(short_strategy, shared_tmp, case):
    """Every rank raises in the same call, within seconds: the last rank its own error, the others a
    RuntimeError naming it; no rank is left in a collective, so the strategy goes on working."""
    r, n = world()
    run, error, text = case(short_strategy, shared_tmp)
    start = time.monotonic()
    if r == n - 1:
        with pytest.raises(error, match=text):
            run()
    else:
        with pytest.raises(RuntimeError) as info:
            run()
        assert not isinstance(info.value, CollectiveTimeoutError), info.value
        message = str(info.value)
        assert message.startswith(f"rank {r}: the input pipeline failed elsewhere in epoch 0"), message
        assert f"rank {n - 1}: {error.__name__}: " in message and text in message, message
    assert time.monotonic() - start < 10  # the deadline is 20 s
    assert short_strategy.reduce("sum", np.ones(1), axis=None).tolist() == [n]


def test_a_chunk_failing_to_reach_the_device_on_the_last_rank_stops_every_rank(short_strategy, monkeypatch):
    """The conversion of a chunk (its copy to the device) fails on the last rank only, after the chunk was
    read: it is reported through the steps' agreement like a failed read, so no rank waits."""
    r, n = world()
    calls = []

    def finish(converter, chunk):
        calls.append(chunk)
        if r == n - 1 and len(calls) == 2:
            raise MemoryError("out of device memory")
        return chunk

    monkeypatch.setattr(distributed, "_finish", finish)
    it = iter(distribute_dataset(short_strategy, NoLen(4 * n), prefetch=0))
    assert values([next(it)]) == [r]
    start = time.monotonic()
    if r == n - 1:
        with pytest.raises(MemoryError, match="out of device memory"):
            next(it)
    else:
        expected = f"(offset {n}, reading): rank {n - 1}: MemoryError: out of device memory. Each of those ranks"
        with pytest.raises(RuntimeError, match=re.escape(expected)):
            next(it)
    assert time.monotonic() - start < 10  # the deadline is 20 s
    assert short_strategy.reduce("sum", np.ones(1), axis=None).tolist() == [n]


@pytest.mark.parametrize("steps_per_transfer", [1, 2])
def test_a_chunk_of_unknown_length_costs_one_allreduce(strategy, monkeypatch, steps_per_transfer):
    """Batched files (exact: every rank runs the most steps): one allreduce per chunk agrees on the steps and
    on whether every rank's input succeeded, plus the check that every rank opened its source (none at 1 rank)."""
    _, n = world()
    contents, names = _ten_files_of_four()
    files = FileDataset(names, contents.__getitem__, global_batch_size=n, remainder="partial")
    dist = distribute_dataset(strategy, files, prefetch=0, steps_per_transfer=steps_per_transfer)
    communicator = strategy.communicator
    names_seen = []
    allreduce = communicator.allreduce

    def counting(*args, **kwargs):
        names_seen.append(kwargs.get("name"))
        return allreduce(*args, **kwargs)

    monkeypatch.setattr(communicator, "allreduce", counting)
    steps = len(list(dist))
    monkeypatch.undo()
    chunks = steps // steps_per_transfer + 1  # the last one is short (possibly empty): the end
    assert steps == max(4 * len(range(rank, 10, n)) for rank in range(n))
    assert names_seen == ["data: epoch start"] * (n > 1) + ["data: steps ready"] * chunks


def test_the_input_layer_needs_only_an_input_host():
    """No strategy: any object with rank, num_replicas_in_sync, backend and communicator distributes data."""
    r, n = world()
    with Communicator(MPI.COMM_WORLD) as comm:
        host = types.SimpleNamespace(
            rank=comm.rank, num_replicas_in_sync=comm.size, backend=comm.backend, communicator=comm
        )
        assert values(distribute_dataset(host, NoLen(3 * n))) == [r, n + r, 2 * n + r]
        assert values(distribute_datasets_from_function(host, lambda ctx: [ctx.input_pipeline_id])) == [r]


# -- 6. multi-step loops ----------------------------------------------------------------------


def test_run_steps_on_dataset_records_the_last_step(strategy):
    r, n = world()
    it = iter(distribute_dataset(strategy, range(7 * n), steps_per_transfer=3))
    runs = []

    def step(ctx, x):
        assert isinstance(ctx, MultiStepContext) and not isinstance(x, PerReplica)
        ctx.set_last_step_output("sum", x * 1.0, reduce_op="sum")
        ctx.set_last_step_output("mine", x)
        ctx.set_last_step_output("first", x * 1.0, reduce_op="only_first_replica")
        ctx.set_non_tensor_output("rank", r)
        with pytest.raises(ValueError, match=r"VariableAggregation.NONE"):
            ctx.set_last_step_output("bad", x, reduce_op="none")  # refused where it is recorded: local

    while True:
        ctx = strategy.run_steps_on_dataset(step, it, 3)
        runs.append(ctx)
        if ctx.steps_run < 3:
            break
    assert [c.steps_run for c in runs] == [3, 3, 1]
    for k, ctx in enumerate(runs):
        last = 3 * k + ctx.steps_run - 1
        assert float(ctx.last_step_outputs["sum"]) == last * n * n + n * (n - 1) / 2
        assert isinstance(ctx.last_step_outputs["mine"], PerReplica)
        assert int(ctx.last_step_outputs["mine"].get()) == last * n + r
        assert float(ctx.last_step_outputs["first"]) == last * n  # replica 0's element on every rank
        assert ctx.non_tensor_outputs == {"rank": r}
    empty = strategy.run_steps_on_dataset(step, it, 3)
    assert empty.steps_run == 0 and empty.last_step_outputs == {}
    with pytest.raises(TypeError, match="needs an iterator"):
        strategy.run_steps_on_dataset(step, distribute_dataset(strategy, range(3)), 3)


def test_run_steps_on_array_batches_in_one_transfer(strategy):
    _, n = world()
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(24.0), 3 * n), steps_per_transfer=4, prefetch=1)

    def step(ctx, batch):
        ctx.set_last_step_output("mean", batch.mean(), reduce_op="mean")

    ctx = strategy.run_steps_on_dataset(step, iter(dist), 4)
    steps = min(4, 24 // (3 * n))
    last = np.arange(24.0)[(steps - 1) * 3 * n : steps * 3 * n]
    assert ctx.steps_run == steps and float(ctx.last_step_outputs["mean"]) == last.mean()


# -- 7. resumable position ---------------------------------------------------------------------


def _dataset(kind):
    if kind == "array":
        return ArrayDataset(np.arange(23), 6, shuffle=True, seed=4, epoch=2, remainder="partial")
    return range(23)


def _read(strategy, it, steps=None):
    """This rank's samples of up to ``steps`` steps (all when None)."""
    seen = []
    for k, element in enumerate(it):
        seen.extend(np.atleast_1d(element.get()).tolist())
        if steps is not None and k + 1 == steps:
            break
    return seen


@pytest.mark.parametrize("direction", ["grow", "shrink"])
@pytest.mark.parametrize("kind", ["array", "elements"])
def test_resume_on_another_number_of_ranks_sees_each_sample_once(kind, direction):
    """Stop mid-epoch on a sub-communicator, restore on another size: nothing skipped, nothing repeated.

    At 3 ranks, "grow" stops after 2 steps at 2 ranks (a Split of COMM_WORLD;
    the third rank waits) and restores on all 3.
    """
    world_comm = MPI.COMM_WORLD
    r, n = world()
    small = max(1, n - 1)
    first, second = (small, n) if direction == "grow" else (n, small)
    seen, state = [], None
    comm = world_comm.Split(0 if r < first else MPI.UNDEFINED, r)
    if comm != MPI.COMM_NULL:
        phase = MPIStrategy(comm=comm)
        it = iter(distribute_dataset(phase, _dataset(kind)))
        seen += _read(phase, it, steps=2)
        state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
        it.close()
        phase.free()
        comm.Free()
    state = world_comm.bcast(state, root=0)
    comm = world_comm.Split(0 if r < second else MPI.UNDEFINED, r)
    if comm != MPI.COMM_NULL:
        phase = MPIStrategy(comm=comm)
        seen += _read(phase, distribute_dataset(phase, _dataset(kind)).iterator_from_state(state))
        phase.free()
        comm.Free()
    everything = collections.Counter(x for part in world_comm.allgather(seen) for x in part)
    assert state["epoch"] == (2 if kind == "array" else 0) and state["num_replicas"] == first
    if kind == "array":
        assert state["offset"] == 12
        assert everything == collections.Counter(range(23))
    else:
        offset = 2 * first
        assert state["offset"] == offset
        end = offset + (23 - offset) // second * second  # elements past the last full step are dropped
        assert everything == collections.Counter(range(end))


def test_resume_at_the_same_size_and_state_checks(strategy):
    _, n = world()
    dist = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, shuffle=True, seed=1))
    it = iter(dist)
    head = [next(it).get().tolist() for _ in range(2)]
    state = it.get_state()
    assert all(isinstance(v, (int, str)) for v in state.values())
    assert state["offset"] == 4 * n and json.loads(json.dumps(state)) == state
    rest = [e.get().tolist() for e in dist.iterator_from_state(state)]
    assert head + rest == [e.get().tolist() for e in dist]
    other = distribute_dataset(strategy, ArrayDataset(np.arange(31), 2 * n))
    with pytest.raises(ValueError, match="saved for 30 samples but this ArrayDataset has 31"):
        iter(other).set_state(state)
    # the offset counts samples in the saved order: in another one, some would be read twice, others never
    unshuffled = distribute_dataset(strategy, ArrayDataset(np.arange(30), 2 * n, seed=1))
    with pytest.raises(ValueError, match="saved with shuffle 1 but this ArrayDataset has shuffle=False"):
        unshuffled.iterator_from_state(state)
    with pytest.raises(ValueError, match="saved with shuffle 0 but this ArrayDataset has shuffle=True"):
        iter(dist).set_state(iter(unshuffled).get_state())
    with pytest.raises(ValueError, match="is of a 'array' iterator"):
        iter(distribute_dataset(strategy, range(4))).set_state(state)
    local = distribute_datasets_from_function(strategy, lambda ctx: [1, 2, 3])
    moved = dict(iter(local).get_state(), num_replicas=n + 1)
    with pytest.raises(ValueError, match=f"saved at {n + 1} ranks"):
        iter(local).set_state(moved)


# -- GPU (skipped where CuPy sees no device) ---------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_strategy():
    s = MPIStrategy(device="gpu", timeout=30)
    yield s
    s.free()


@pytest.mark.gpu
@pytest.mark.parametrize("steps_per_transfer", [1, 3])
def test_gpu_batches_arrive_on_the_device(gpu_strategy, steps_per_transfer):
    import cupy

    r, n = world()
    data = {"x": np.arange(60, dtype=np.float32).reshape(30, 2), "y": np.arange(30)}
    dist = distribute_dataset(
        gpu_strategy,
        ArrayDataset(data, 2 * n, shuffle=True, seed=3, remainder="partial"),
        steps_per_transfer=steps_per_transfer,
        prefetch=2,
    )
    order = epoch_order(30, 0, 3)
    got = []
    for element in dist:
        assert isinstance(element["x"].get(), cupy.ndarray) and isinstance(element["y"].get(), cupy.ndarray)
        got.append(cupy.asnumpy(element["y"].get()).tolist())
        assert cupy.asnumpy(element["x"].get())[:, 0].tolist() == [2 * v for v in got[-1]]
    plan = batch_plan(30, 2 * n, r, n, remainder="partial")
    assert got == [order[list(range(lo, hi))].tolist() for lo, hi, _ in plan]


@pytest.mark.gpu
def test_gpu_exact_metrics_match_the_host(gpu_strategy):
    import cupy

    host = np.random.default_rng(5).standard_normal(101)
    with gpu_strategy.scope():
        mean = Mean()
    mean.update_state(cupy.asarray(host))  # every rank adds the same values: the mean is theirs
    assert mean.result() == float(sum(fractions.Fraction(v) for v in host.tolist()) / 101)


@pytest.mark.gpu
def test_gpu_elements_of_any_iterable_arrive_on_the_device(gpu_strategy):
    import cupy

    r, n = world()
    data = [(np.full(3, i, dtype=np.float32), i, f"name{i}") for i in range(4 * n)]
    steps = list(distribute_dataset(gpu_strategy, data, steps_per_transfer=2))
    assert len(steps) == 4
    for s, (array, number, name) in enumerate(steps):
        assert isinstance(array.get(), cupy.ndarray) and isinstance(number.get(), cupy.ndarray)
        assert cupy.asnumpy(array.get()).tolist() == [s * n + r] * 3 and int(number.get()) == s * n + r
        assert name.get() == f"name{s * n + r}"
