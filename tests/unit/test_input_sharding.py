"""Serial tests of the input pipeline's arithmetic: sharding as pure functions of (n, rank, size).

No MPI: every function is checked over many (rank, size) pairs by computing
all ranks' shares in one process and comparing their union with the data.
Also here: the serial datasets (ArrayDataset, FileDataset, InputContext), the
exact accumulator behind the metrics, and the prefetcher's device path with a
stand-in for the CUDA stager (the real one is tested with -m gpu).
"""

from __future__ import annotations

import collections
import fractions
import itertools
import math
import threading
from typing import ClassVar

import numpy as np
import pytest

from mpidist._distribute.metrics import WIDTH, _as_float, exact_decode, exact_encode, exact_sum
from mpidist._input import prefetch as _prefetch
from mpidist._input.datasets import ArrayDataset, FileDataset, InputContext, RecordBatches, array_chunks
from mpidist._input.sharding import (
    _split,
    batch_plan,
    batch_rows,
    check_count,
    check_rank,
    choose_shard_policy,
    epoch_order,
    file_shard,
    num_steps,
    per_replica_batch_size,
)

# -- views of the sharding arithmetic that only the tests use ----------------------------


def split_range(count, rank, size):
    """Rank's contiguous share ``[lo, hi)`` of ``count`` items, as the batch split makes it."""
    check_rank(rank, size)
    return _split(check_count("count", count), rank, size)


def shard_indices(num_samples, rank, size, global_batch_size=None, *, offset=0, remainder="drop", auto_shard=True):
    """For each step of an epoch, the positions rank reads (``global_batch_size`` defaults to ``size``)."""
    batch = size if global_batch_size is None else global_batch_size
    return [
        range(lo, hi)
        for lo, hi, _ in batch_plan(
            num_samples, batch, rank, size, offset=offset, remainder=remainder, auto_shard=auto_shard
        )
    ]


def element_index(step, rank, size, offset=0, auto_shard=True):
    """Index of the element rank receives at ``step`` of an element-sharded iterable started at ``offset``."""
    check_rank(rank, size)
    return offset + (step * size + rank if auto_shard else step)


SIZES = range(1, 8)
PAIRS = [(rank, size) for size in SIZES for rank in range(size)]


# -- split_range, per_replica_batch_size ------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_split_range_partitions_evenly_lower_ranks_first(size):
    for count in range(40):
        shares = [split_range(count, rank, size) for rank in range(size)]
        assert [i for lo, hi in shares for i in range(lo, hi)] == list(range(count))
        lengths = [hi - lo for lo, hi in shares]
        assert max(lengths) - min(lengths) <= 1
        assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("bad", [(3, 3), (-1, 2), (0, 0)])
def test_split_range_rejects_ranks_outside_the_world(bad):
    rank, size = bad
    with pytest.raises(ValueError, match=r"rank|size"):
        split_range(5, rank, size)


@pytest.mark.parametrize("size", SIZES)
def test_per_replica_batch_size(size):
    for batch in range(1, 50):
        if batch % size:
            with pytest.raises(ValueError) as info:
                per_replica_batch_size(batch, size)
            assert f"global batch size {batch}" in str(info.value) and f"{size} replicas" in str(info.value)
        else:
            assert per_replica_batch_size(batch, size) == batch // size


def test_input_context_batch_size_error_names_values_and_rank():
    ctx = InputContext(3, 1, 3)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (3, 1, 3)
    assert ctx.get_per_replica_batch_size(12) == 4
    with pytest.raises(ValueError) as info:
        ctx.get_per_replica_batch_size(10)
    message = str(info.value)
    assert "rank 1" in message and "10" in message and "3 replicas" in message and "9 or 12" in message
    assert list(ctx.shard(range(10))) == [1, 4, 7]
    with pytest.raises(ValueError, match=r"rank must be < 3 \(the number of ranks\), got 3"):
        InputContext(3, 3, 3)


# -- element sharding (contract C7) -----------------------------------------------------


def test_range_11_auto_shard_at_two_ranks_gives_the_documented_steps():
    steps = num_steps(11, 2)
    got = [[element_index(s, r, 2) for r in range(2)] for s in range(steps)]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [element_index(s, 1, 2, auto_shard=False) for s in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("rank,size", PAIRS)
def test_element_index_covers_every_full_step_once(rank, size):
    for n in range(30):
        for offset in range(min(n, 7) + 1):
            steps = (n - offset) // size
            mine = [element_index(s, rank, size, offset) for s in range(steps)]
            assert mine == list(range(offset + rank, offset + steps * size, size))


# -- array batches -------------------------------------------------------------------------


def _union(num_samples, size, batch, remainder, offset=0):
    """Every rank's positions, over all steps, with the step they were read at."""
    seen = collections.Counter()
    per_step = []
    for rank in range(size):
        for step, positions in enumerate(
            shard_indices(num_samples, rank, size, batch, offset=offset, remainder=remainder)
        ):
            seen.update(positions)
            per_step.append((step, rank, positions))
    return seen, per_step


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("remainder", ["drop", "partial", "mask"])
def test_global_batches_cover_each_sample_exactly_once(size, remainder):
    for per_rank in (1, 2, 3):
        batch = per_rank * size
        for n in range(4 * batch + 3):
            seen, per_step = _union(n, size, batch, remainder)
            kept = n - n % batch if remainder == "drop" else n
            assert seen == collections.Counter(range(kept)), (n, batch)
            assert all(v == 1 for v in seen.values())
            for step, rank, positions in per_step:
                full = (step + 1) * batch <= n
                if full:  # a full step: B / N contiguous rows per rank, in rank order
                    start = step * batch + rank * per_rank
                    assert positions == range(start, start + per_rank)
                else:
                    assert len(positions) <= per_rank


@pytest.mark.parametrize("rank,size", PAIRS)
def test_batch_rows_without_auto_shard_reads_the_whole_batch(rank, size):
    assert batch_rows(12, 20, 6, rank, size, auto_shard=False) == (12, 18)
    assert batch_rows(18, 20, 6, rank, size, auto_shard=False) == (18, 20)
    lo, hi = batch_rows(18, 20, 6, rank, size)  # 2 rows left, split over the ranks
    assert (lo, hi) == tuple(18 + x for x in split_range(2, rank, size))


def test_num_steps():
    assert [num_steps(23, 6, 0, r) for r in ("drop", "partial", "mask")] == [3, 4, 4]
    assert num_steps(23, 6, 20, "partial") == 1 and num_steps(23, 6, 20, "drop") == 0
    assert num_steps(23, 6, 23, "partial") == 0 and num_steps(5, 6, 9, "partial") == 0
    with pytest.raises(ValueError, match="remainder must be one of drop, partial, mask"):
        num_steps(5, 2, 0, "pad")


@pytest.mark.parametrize("before", [1, 2, 3, 4])
@pytest.mark.parametrize("after", [1, 2, 3, 4])
def test_resume_at_another_size_sees_every_sample_once(before, after):
    """Stop after k steps at `before` ranks, continue from the global offset at `after` ranks."""
    batch, n = 12, 53  # 12 is divisible by 1, 2, 3 and 4
    for k in range(num_steps(n, batch, 0, "partial") + 1):
        seen = collections.Counter()
        for rank in range(before):
            for positions in shard_indices(n, rank, before, batch, remainder="partial")[:k]:
                seen.update(positions)
        offset = min(n, k * batch)
        for rank in range(after):
            for positions in shard_indices(n, rank, after, batch, offset=offset, remainder="partial"):
                seen.update(positions)
        assert seen == collections.Counter(range(n))


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    a = epoch_order(100, epoch=3, seed=7)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, epoch_order(100, epoch=3, seed=7))
    assert not np.array_equal(a, epoch_order(100, epoch=4, seed=7))
    assert not np.array_equal(a, epoch_order(100, epoch=3, seed=8))
    assert np.array_equal(epoch_order(5, 9, 9, shuffle=False), np.arange(5))
    with pytest.raises(ValueError, match="seed must be >= 0"):
        epoch_order(5, 0, -1)


# -- files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_file_policy_and_file_shards(size):
    for files in range(12):
        policy = choose_shard_policy(files, size)
        assert policy == ("file" if files >= size else "element")
        if policy == "file":
            shards = [file_shard(files, rank, size) for rank in range(size)]
            assert sorted(itertools.chain(*shards)) == list(range(files))
            assert all(shard for shard in shards)
        else:
            with pytest.raises(ValueError, match=f"{files} files for {size} ranks"):
                choose_shard_policy(files, size, "file")
        assert choose_shard_policy(files, size, "element") == "element"
    with pytest.raises(ValueError, match="shard_policy must be one of"):
        choose_shard_policy(3, 2, "files")


def test_file_dataset_reads_files_in_epoch_order():
    contents = {f"f{i}": [f"f{i}.{j}" for j in range(i + 1)] for i in range(4)}
    ds = FileDataset(list(contents), contents.__getitem__)
    assert list(ds) == [x for f in contents for x in contents[f]]
    shuffled = FileDataset(list(contents), contents.__getitem__, shuffle=True, seed=1, epoch=2)
    assert shuffled.epoch_files() == [f"f{i}" for i in epoch_order(4, 2, 1)]
    with pytest.raises(TypeError, match="single path"):
        FileDataset("f0", contents.__getitem__)


def test_batched_file_dataset_serial_batches():
    contents = {f"f{i}": [{"x": np.full(2, i * 10 + j), "y": j} for j in range(i + 1)] for i in range(4)}  # 10 records
    ys = [j for i in range(4) for j in range(i + 1)]
    batches = list(FileDataset(list(contents), contents.__getitem__, global_batch_size=4))  # "partial" by default
    assert [b["y"].tolist() for b in batches] == [ys[0:4], ys[4:8], ys[8:10]]
    assert batches[0]["x"].shape == (4, 2)
    masked = list(FileDataset(list(contents), contents.__getitem__, global_batch_size=4, remainder="mask"))
    assert all(b["y"].shape == (4,) for b, _ in masked)
    assert masked[-1][0]["y"][masked[-1][1]].tolist() == ys[8:10]
    assert masked[-1][1].tolist() == [True, True, False, False]
    dropped = list(FileDataset(list(contents), contents.__getitem__, global_batch_size=4, remainder="drop"))
    assert [b["y"].tolist() for b in dropped] == [ys[0:4], ys[4:8]]
    with pytest.raises(ValueError, match="pass global_batch_size too"):
        FileDataset(list(contents), contents.__getitem__, remainder="mask")
    with pytest.raises(ValueError, match="remainder must be one of"):
        FileDataset(list(contents), contents.__getitem__, global_batch_size=4, remainder="pad")


@pytest.mark.parametrize("rank,size", PAIRS)
@pytest.mark.parametrize("remainder", ["partial", "mask", "drop"])
def test_record_batches_share_each_group_once(rank, size, remainder):
    records, group = list(range(23)), 2 * size
    shares = []
    for pick in range(size):
        batches = RecordBatches(group, pick, size, remainder, group // size)
        steps = [element for chunk in batches.chunks(iter(records), 3) for element, _ in chunk.steps()]
        shares.append([b[0][b[1]].tolist() if remainder == "mask" else b.tolist() for b in steps])
    kept = records if remainder != "drop" else records[: len(records) // group * group]
    assert sorted(x for share in shares for step in share for x in step) == kept
    assert {len(share) for share in shares} == {num_steps(len(records), group, 0, remainder)}
    assert shares[rank] == [
        records[lo:hi] for lo, hi, _ in batch_plan(len(records), group, rank, size, remainder=remainder)
    ]


def test_record_batches_filler_has_the_records_structure():
    batches = RecordBatches(2, 0, 1, "partial", 2)
    with pytest.raises(ValueError, match="no record has been read"):
        batches.filler(1)
    list(batches.chunks(iter([(np.zeros(3, np.float32), 1)]), 1))
    ((x, y),) = [element for element, _ in batches.filler(1).steps()]
    assert x.shape == (0, 3) and x.dtype == np.float32 and y.shape == (0,)
    masked = RecordBatches(2, 0, 1, "mask", 2)
    list(masked.chunks(iter([np.ones(3)]), 1))
    steps = masked.filler(2).steps()
    assert [(e[0].shape, e[1].tolist(), advance) for e, advance in steps] == [((2, 3), [False, False], 0)] * 2


# -- ArrayDataset (serial iteration, chunks) -----------------------------------------------------


def test_array_dataset_serial_batches_and_structure():
    x, y = np.arange(10) * 1.5, np.arange(10)
    ds = ArrayDataset({"x": x, "y": y}, 4)
    batches = list(ds)
    assert len(ds) == len(batches) == 2
    assert [b["y"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not batches[0]["x"].flags.writeable  # unshuffled batches are read-only views
    partial = list(ArrayDataset((x, y), 4, remainder="partial"))
    assert [b[1].tolist() for b in partial] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    masked = list(ArrayDataset(y, 4, remainder="mask"))
    assert all(len(b) == 4 for b, _ in masked)
    assert masked[-1][0][masked[-1][1]].tolist() == [8, 9] and masked[-1][1].tolist() == [True, True, False, False]
    shuffled = list(ArrayDataset(y, 5, shuffle=True, seed=2, epoch=1))
    assert np.concatenate(shuffled).tolist() == epoch_order(10, 1, 2).tolist()


def test_array_dataset_rejects_bad_arrays():
    with pytest.raises(ValueError, match=r"\['a'\]: 3, \['b'\]: 4"):
        ArrayDataset({"a": np.zeros(3), "b": np.zeros(4)}, 2)
    with pytest.raises(TypeError, match="at least one dimension"):
        ArrayDataset(np.float64(1.0), 1)
    with pytest.raises(ValueError, match="global_batch_size must be >= 1"):
        ArrayDataset(np.zeros(3), 0)


@pytest.mark.parametrize("rank,size", [(r, s) for s in (1, 2, 3) for r in range(s)])
@pytest.mark.parametrize("remainder", ["drop", "partial", "mask"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_chunks_of_k_steps_equal_k_single_steps(rank, size, remainder, shuffle):
    """Gathering k steps at once (one transfer) gives the same batches as k gathers."""
    data = {"x": np.arange(29.0)[:, None] * [1, -1], "i": np.arange(29)}
    ds = ArrayDataset(data, 6, shuffle=shuffle, seed=5, remainder=remainder)

    def steps(k, offset=0):
        chunks = array_chunks(ds, epoch=2, offset=offset, rank=rank, size=size, auto_shard=True, steps=k, seed=5)
        return [(e, adv) for chunk in chunks for e, adv in chunk.steps()]

    single = steps(1)
    order = epoch_order(29, 2, 5, shuffle)
    expected = shard_indices(29, rank, size, 6, remainder=remainder)
    assert len(single) == len(expected)
    for (element, _), positions in zip(single, expected):
        batch, mask = element if remainder == "mask" else (element, None)
        rows = batch["i"] if mask is None else batch["i"][mask]
        assert rows.tolist() == order[list(positions)].tolist()
        assert np.array_equal(batch["x"][:, 0], batch["i"])
    for k in (2, 3, 7):
        chunked = steps(k)
        assert len(chunked) == len(single)
        for (a, adv_a), (b, adv_b) in zip(single, chunked):
            assert adv_a == adv_b and _same(a, b)
    consumed = sum(adv for _, adv in single)
    assert consumed == (24 if remainder == "drop" else 29)  # the global offset at the end of the epoch


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return np.array_equal(a, b)


# -- exact accumulator ------------------------------------------------------------------------


def _wide_values(seed, n=64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-300, 300, n)
    return np.concatenate([x, [5e-324, -5e-324, 1.7e308, -1e-310, 0.0, -0.0, 0.1, 1e16, 1.0, -1e16]])


@pytest.mark.parametrize("seed", range(20))
def test_exact_sum_is_correctly_rounded_and_order_free(seed):
    x = _wide_values(seed)
    reference = math.fsum(x)
    assert _as_float(exact_sum(x)) == reference
    rng = np.random.default_rng(seed + 100)
    for parts in (2, 3, 5):  # split over "ranks" in any order: the int64 sum is the same
        shuffled = rng.permutation(x)
        rows = [exact_sum(shuffled[i::parts]) for i in range(parts)]
        assert _as_float(np.sum(rows, axis=0)) == reference
    total, *special = exact_decode(exact_sum(x))
    assert fractions.Fraction(total, 1 << 1074) == sum(map(fractions.Fraction, x.tolist()))
    assert special == [0, 0, 0]
    encoded = exact_encode(total)
    assert encoded.shape == (WIDTH,) and (encoded[:-4] >= 0).all() and (encoded[:-4] < 1 << 32).all()
    assert exact_decode(encoded)[0] == total


def test_exact_sum_non_finite_values():
    assert math.isnan(_as_float(exact_sum([1.0, np.nan])))
    assert _as_float(exact_sum([1.0, np.inf])) == math.inf
    assert _as_float(exact_sum([-np.inf, 2.0])) == -math.inf
    assert math.isnan(_as_float(exact_sum([np.inf, -np.inf])))
    assert _as_float(exact_sum([1.7e308, 1.7e308])) == math.inf  # exact total beyond float64: overflows once
    assert _as_float(exact_sum([1.7e308, 1.7e308, -1.7e308])) == 1.7e308  # but not on the way


# -- prefetch's device path, with a stand-in for the CUDA stager ----------------------------------


class _FakeStager:
    """Records where copies start and finish; stands in for DeviceStager where no GPU exists."""

    log: ClassVar[list] = []

    def __init__(self, backend):
        self.log.clear()

    def start(self, host):
        self.log.append(("start", threading.current_thread().name, host.shape))
        return host.copy()

    def finish(self, token):
        self.log.append(("finish", threading.current_thread().name, token.shape))
        return token


class _FakeGpuBackend:
    is_gpu = True

    @staticmethod
    def asarray(value, dtype=None):
        return np.asarray(value, dtype=dtype)


@pytest.mark.parametrize("depth", [0, 2])
def test_device_copies_start_in_the_producer_and_finish_in_the_consumer(monkeypatch, depth):
    monkeypatch.setattr(_prefetch, "DeviceStager", _FakeStager)
    converter = _prefetch.Converter(_FakeGpuBackend())
    ds = ArrayDataset((np.arange(10), np.arange(10) * 2), 4, remainder="mask")
    chunks = array_chunks(ds, epoch=0, offset=0, rank=0, size=1, auto_shard=True, steps=2, seed=0)
    pipe = _prefetch.Prefetcher(chunks, converter.prepare, depth)
    steps = []
    while (chunk := pipe.get()) is not None:
        steps += chunk.map_leaves(converter.finish).steps()
    pipe.close()
    assert [(b[0].tolist(), m.tolist()) for (b, m), _ in steps] == [
        ([0, 1, 2, 3], [True] * 4),
        ([4, 5, 6, 7], [True] * 4),
        ([8, 9, 0, 1], [True, True, False, False]),
    ]
    producer = "mpidist-prefetch" if depth else "MainThread"
    starts = [entry for entry in _FakeStager.log if entry[0] == "start"]
    finishes = [entry for entry in _FakeStager.log if entry[0] == "finish"]
    assert [shape for _, _, shape in starts] == [(8,)] * 3 + [(4,)] * 3  # one copy per leaf per 2 steps
    assert {thread for _, thread, _ in starts} == {producer}
    assert {thread for _, thread, _ in finishes} == {"MainThread"} and len(finishes) == 6
    assert converter.finish(converter.prepare(7)).shape == ()  # numbers become 0-d device arrays


def test_default_prefetch_follows_the_cores_the_rank_has(monkeypatch):
    import os

    from mpidist._comm.backend import Backend
    from mpidist._input.prefetch import default_depth

    cpu = Backend(np)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert [default_depth(cpu, ranks) for ranks in (1, 2, 3, 4, 8)] == [2, 2, 0, 0, 0]
    assert default_depth(cpu, 1, views=True) == 0  # batches that are views of the arrays: nothing to prepare

    class Gpu:
        is_gpu = True

    assert default_depth(Gpu(), 8) == 2  # copies overlap the step on a side stream
    assert default_depth(Gpu(), 8, views=True) == 2  # views still need their copies to the device


def test_shuffled_batches_reuse_memory_only_once_the_caller_dropped_them():
    data = np.arange(400.0).reshape(200, 2)
    kept = list(ArrayDataset(data, 4, shuffle=True, seed=3))  # every batch held: none may be written into again
    assert len({b.__array_interface__["data"][0] for b in kept}) == len(kept) == 50
    np.testing.assert_array_equal(np.sort(np.concatenate(kept)[:, 0]), data[:, 0])
    buffers, seen = set(), []
    for batch in ArrayDataset(data, 4, shuffle=True, seed=3):  # each dropped before the next: memory reused
        buffers.add(batch.__array_interface__["data"][0])
        seen.append(batch.copy())
        del batch
    assert len(buffers) <= 3
    np.testing.assert_array_equal(np.concatenate(seen), np.concatenate(kept))  # the same batches, in order
