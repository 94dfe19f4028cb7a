"""Checkpoint save/restore under mpiexec (1, 2 and 3 ranks), also across numbers of ranks.

Saving at one size and restoring at another happens in one job: strategies over
sub-communicators of the first ``size`` world ranks (``COMM_WORLD.Split``); ranks outside
a group skip that part. Expected values derive from rank and size. Every rank makes the
same collective calls in the same order, also where a call is expected to fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist._checkpoint import checkpoint as _checkpoint, format as fmt, reader
from mpidist._checkpoint.checkpoint import Checkpoint, read_checkpoint
from mpidist._errors import ChecksumError
from states import Statistics

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
COUNTS = np.array([1, 5, 7, 11, 13, 100, 12345], dtype=np.int64)
STEPS = 5


class ShardedRange:
    """A tiny sharded input: at each step rank r of n receives element position + r of 0, 1, 2, ...

    Its state is the global position, the same on every rank, so it resumes exactly on
    any number of ranks.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.position = rank, size, 0

    def __next__(self) -> int:
        value = self.position + self.rank
        self.position += self.size
        return value

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


class PerRankState:
    """An iterator-like object whose state differs between ranks."""

    def __init__(self, value: int) -> None:
        self.value = value

    def get_state(self) -> dict:
        return {"value": self.value}

    def set_state(self, state: dict) -> None:
        self.value = state["value"]


@pytest.fixture
def shared_dir(shared_tmp):
    """The checkpoint directory, inside a fresh directory every rank sees (``shared_tmp``)."""
    return shared_tmp / "ckpt"


@contextlib.contextmanager
def group(size: int):
    """A strategy over world ranks 0..size-1, ``None`` on the others. Collective over COMM_WORLD."""
    comm = WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)
    if comm == MPI.COMM_NULL:
        yield None
        return
    strategy = mpidist.MPIStrategy(comm=comm, device="cpu")
    try:
        yield strategy
    finally:
        strategy.free()
        comm.Free()


def needs(*sizes: int) -> None:
    if max(sizes) > WORLD.size:
        pytest.skip(f"needs {max(sizes)} ranks, the world has {WORLD.size}")


def build(strategy, fill: bool) -> dict:
    """The test model. With ``fill``, values from (rank, size) and STEPS input steps taken."""
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        on_read = dict(synchronization=mpidist.VariableSynchronization.ON_READ)
        model = dict(
            weights=mpidist.Variable(np.arange(40.0).reshape(8, 5) * (n + 0.5) if fill else np.zeros((8, 5))),
            total=mpidist.Variable(np.zeros(6), aggregation="sum", **on_read),
            count=mpidist.Variable(np.zeros(7, np.int64), aggregation="sum", **on_read),
            mean=mpidist.Variable(np.zeros(3), aggregation="mean", **on_read),
            first=mpidist.Variable(np.zeros(2), aggregation="only_first_replica", **on_read),
        )
    model["table"] = np.arange(6, dtype=np.int32) * n * 10 if fill and r == 0 else np.full(6, -1, np.int32)
    model["inputs"] = ShardedRange(r, n)
    if fill:

        def step():
            model["total"].assign(np.arange(6.0) + r)
            model["count"].assign(COUNTS * (r + 1))
            model["mean"].assign(np.full(3, 2.0 * r))
            model["first"].assign(np.full(2, 10.0 + r))

        strategy.run(step)
        for _ in range(STEPS):
            next(model["inputs"])
    return model


def components(variable) -> np.ndarray:
    return np.asarray(variable.values[0])


def check_restored(strategy, model: dict, saved_at: int) -> None:
    """Values a model saved by ``saved_at`` ranks must have after restore on this strategy's ranks."""
    a, n, r = saved_at, strategy.num_replicas_in_sync, strategy.rank
    np.testing.assert_array_equal(components(model["weights"]), np.arange(40.0).reshape(8, 5) * (a + 0.5))
    total = a * np.arange(6.0) + a * (a - 1) / 2
    np.testing.assert_array_equal(components(model["total"]), total / n)
    count = COUNTS * (a * (a + 1) // 2)
    quotient, remainder = np.divmod(count, n)
    np.testing.assert_array_equal(components(model["count"]), quotient + (remainder > r))
    np.testing.assert_array_equal(components(model["mean"]), np.full(3, a - 1.0))
    np.testing.assert_array_equal(components(model["first"]), np.full(2, 10.0))
    np.testing.assert_array_equal(model["table"], np.arange(6) * a * 10)
    with strategy.scope():
        np.testing.assert_allclose(model["total"].numpy(), total, rtol=1e-15)
        np.testing.assert_array_equal(model["count"].numpy(), count)  # integers: exact
        np.testing.assert_array_equal(model["mean"].numpy(), np.full(3, a - 1.0))
        np.testing.assert_array_equal(model["first"].numpy(), np.full(2, 10.0))
    assert next(model["inputs"]) == STEPS * a + r  # the input resumes exactly where it stopped


@pytest.mark.parametrize("block_bytes", [32, fmt.BLOCK_BYTES])
@pytest.mark.parametrize("saved_at,restored_at", [(a, b) for a in (1, 2, 3) for b in (1, 2, 3)])
def test_restore_on_a_different_number_of_ranks(shared_dir, saved_at, restored_at, block_bytes):
    needs(saved_at, restored_at)
    with group(saved_at) as strategy:
        if strategy is not None:
            model = build(strategy, fill=True)
            path = Checkpoint(**model).save(shared_dir, block_bytes=block_bytes)
            assert path == str(shared_dir / "ckpt-000001")
    with group(restored_at) as strategy:
        if strategy is not None:
            model = build(strategy, fill=False)
            assert Checkpoint(**model).restore(shared_dir) == str(shared_dir / "ckpt-000001")
            check_restored(strategy, model, saved_at)
    if WORLD.rank == 0:
        manifest = json.loads((shared_dir / "ckpt-000001" / fmt.MANIFEST).read_text())
        assert manifest["world_size"] == saved_at
        arrays = read_checkpoint(shared_dir)
        np.testing.assert_array_equal(arrays["count"], COUNTS * (saved_at * (saved_at + 1) // 2))
        np.testing.assert_array_equal(arrays["mean"], np.full(3, saved_at - 1.0))


@pytest.fixture
def strategy():
    s = mpidist.MPIStrategy(device="cpu")
    yield s
    s.free()


def test_large_arrays_are_exchanged_in_rounds(strategy, shared_dir, monkeypatch):
    monkeypatch.setattr(_checkpoint, "_MAX_GATHER_BYTES", 100)
    model = build(strategy, fill=True)
    Checkpoint(**model).save(shared_dir, block_bytes=32)
    model = build(strategy, fill=False)
    Checkpoint(**model).restore(shared_dir)
    check_restored(strategy, model, strategy.num_replicas_in_sync)


def test_each_rank_writes_and_reads_only_its_share(strategy, shared_dir, monkeypatch):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        weights = mpidist.Variable(np.arange(96, dtype=np.float32), name="weights")  # 384 bytes: 12 blocks
    written, read = [], []
    real_write, real_read = fmt._pwrite_all, reader._read_block

    def pwrite_all(fd, data, offset):
        if offset > 0:  # headers and the manifest are written at offset 0, data after the header
            written.append(len(data))
        real_write(fd, data, offset)

    def read_block(fd, out, *args):
        read.append(len(out))
        real_read(fd, out, *args)

    monkeypatch.setattr(fmt, "_pwrite_all", pwrite_all)
    monkeypatch.setattr(reader, "_read_block", read_block)
    Checkpoint(weights=weights).save(shared_dir, block_bytes=32)
    Checkpoint(weights=weights).restore(shared_dir)
    lo, hi = fmt.share_ranges([384], n, 32)[0][r]
    assert sum(written) == hi - lo and sum(read) == hi - lo
    assert hi - lo <= 384 // n + 32
    np.testing.assert_array_equal(components(weights), np.arange(96, dtype=np.float32))


def test_mismatched_items_raise_value_error_on_every_rank_and_modify_nothing(strategy, shared_dir):
    with strategy.scope():
        weights = mpidist.Variable(np.arange(3.0), name="weights")
    Checkpoint(weights=weights, table=np.zeros(2, np.int32)).save(shared_dir)
    with strategy.scope():
        wrong_shape = mpidist.Variable(np.full(4, 7.0))
        wrong_dtype = mpidist.Variable(np.full(3, 7, np.float32))
    table = np.full(2, 5, np.int32)
    with pytest.raises(ValueError, match=r"'weights' has shape \(3,\) in the checkpoint but \(4,\) here"):
        Checkpoint(weights=wrong_shape, table=table).restore(shared_dir)
    with pytest.raises(ValueError, match="'weights' has dtype float64 in the checkpoint but float32 here"):
        Checkpoint(weights=wrong_dtype, table=table).restore(shared_dir)
    with pytest.raises(ValueError, match="'bias' is not in the checkpoint"):
        Checkpoint(bias=table, weights=weights).restore(shared_dir)
    with strategy.scope(), pytest.raises(ValueError, match="'table' is of kind 'state' here but 'array' in the"):
        Checkpoint(table=ShardedRange(0, 1)).restore(shared_dir)
    assert (components(wrong_shape) == 7).all() and (components(wrong_dtype) == 7).all() and (table == 5).all()


def test_ranks_that_disagree_raise_on_every_rank_and_write_nothing(strategy, shared_dir):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    if n == 1:
        pytest.skip("needs two ranks to disagree")
    with strategy.scope(), pytest.raises(ValueError, match="ranks disagree on the checkpoint's items"):
        Checkpoint(table=np.zeros(3 if r == n - 1 else 2)).save(shared_dir, keep=1)
    with strategy.scope(), pytest.raises(ValueError, match="ranks disagree on the arguments"):
        Checkpoint(table=np.zeros(2)).save(shared_dir, keep=1 + (r == n - 1))
    assert not shared_dir.exists() or not fmt.list_versions(shared_dir)


@pytest.mark.parametrize("bad", [{"keep": 0}, {"block_bytes": 48}], ids=["keep", "block_bytes"])
def test_an_invalid_argument_on_one_rank_raises_on_every_rank_and_writes_nothing(shared_dir, bad):
    strategy = mpidist.MPIStrategy(device="cpu", timeout=10)  # the others must not wait out a deadline
    n, r = strategy.num_replicas_in_sync, strategy.rank
    if n == 1:
        strategy.free()
        pytest.skip("needs two ranks to disagree")
    (name,) = bad
    with strategy.scope(), pytest.raises(ValueError) as info:
        Checkpoint(table=np.zeros(2)).save(shared_dir, **(bad if r == n - 1 else {}))
    message = str(info.value)
    assert message.startswith(f"rank {r}: ") and f"rank {n - 1}: ValueError: Checkpoint.save: {name} must be" in message
    assert not shared_dir.exists() or not fmt.list_versions(shared_dir)
    strategy.free()


def test_a_restore_from_another_path_on_one_rank_raises_on_every_rank_and_modifies_nothing(shared_dir):
    strategy = mpidist.MPIStrategy(device="cpu", timeout=10)  # the others must not wait out a deadline
    n, r = strategy.num_replicas_in_sync, strategy.rank
    if n == 1:
        strategy.free()
        pytest.skip("needs two ranks to disagree")
    table = np.full(2, 1.0)
    checkpoint = Checkpoint(table=table)
    with strategy.scope():
        older = checkpoint.save(shared_dir, keep=2)
        table[...] = 2
        checkpoint.save(shared_dir, keep=2)
        table[...] = 3
        # rank 0 alone finds the save: the others restored the one it found, whatever they asked for
        with pytest.raises(ValueError) as info:
            checkpoint.restore(older if r == 0 else shared_dir)
        message = str(info.value)
        assert message.startswith(f"rank {r}: ") and "nothing was modified" in message
        assert f"ranks disagree on the path of restore: rank 0: {older}; rank 1: {shared_dir}" in message
        assert (table == 3).all()
        # a path that is no path on one rank: every rank raises in the same call (it left alone before)
        for call in (checkpoint.restore, checkpoint.save):
            with pytest.raises(TypeError, match=f"rank {n - 1}: TypeError: expected str, bytes or os.PathLike"):
                call(None if r == n - 1 else shared_dir)
        assert (table == 3).all() and len(fmt.list_versions(shared_dir)) == 2
        assert checkpoint.restore(shared_dir) == str(shared_dir / "ckpt-000002") and (table == 2).all()
    strategy.free()


def test_a_checksum_error_in_one_ranks_share_fails_every_rank(strategy, shared_dir):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    model = build(strategy, fill=True)
    Checkpoint(**model).save(shared_dir, block_bytes=32)
    WORLD.Barrier()
    if r == 0:  # damage the last block of "weights": the last rank reads it
        path = next((shared_dir / "ckpt-000001").glob("*weights.npy"))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    WORLD.Barrier()
    model = build(strategy, fill=False)
    model["table"][...] = 3
    with pytest.raises(ChecksumError, match="nothing was modified") as info:
        Checkpoint(**model).restore(shared_dir)
    assert info.value.entry == "weights" and info.value.file.endswith("weights.npy")
    assert f"rank {n - 1}:" in str(info.value) and "weights.npy: 'weights', bytes" in str(info.value)
    assert (components(model["weights"]) == 0).all() and (model["table"] == 3).all()
    assert model["inputs"].position == 0


class FailingSetState(ShardedRange):
    """Refuses its first set_state on the last rank (after changing its position)."""

    refused = False

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        if self.rank == self.size - 1 and not self.refused:
            self.refused = True
            raise RuntimeError(f"set_state refused on rank {self.rank}")


def test_a_failing_set_state_is_rolled_back_on_every_rank(strategy, shared_dir):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    model = build(strategy, fill=True)
    Checkpoint(**model).save(shared_dir)
    model = build(strategy, fill=False)
    inputs, other = FailingSetState(r, n), ShardedRange(r, n)
    next(inputs), next(other)
    with pytest.raises(RuntimeError, match=f"rank {n - 1}: RuntimeError: set_state refused on rank {n - 1}"):
        Checkpoint(inputs=inputs, more=other, weights=model["weights"]).restore(
            _renamed(shared_dir, {"inputs": "more"})
        )
    assert inputs.position == n and other.position == n
    assert (components(model["weights"]) == 0).all()


def _renamed(shared_dir: Path, copies: dict) -> Path:
    """A copy of the newest save with state entries duplicated under new names (rank 0 writes it)."""
    target = shared_dir.parent / "renamed"
    if WORLD.rank == 0:
        with reader.Save.open(shared_dir) as save:
            source, manifest = save.directory, save.manifest
        shutil.copytree(source, target)
        for old, new in copies.items():
            manifest["entries"].append({**next(e for e in manifest["entries"] if e["name"] == old), "name": new})
        (target / fmt.MANIFEST).write_bytes(fmt.encode_manifest(manifest))
    WORLD.Barrier()
    return target


def test_per_rank_iterator_states_restore_only_on_the_same_number_of_ranks(shared_dir):
    size = WORLD.size
    with group(size) as strategy:
        state = PerRankState(100 + strategy.rank)
        with strategy.scope():
            Checkpoint(state=state).save(shared_dir)
        state.value = -1
        with strategy.scope():
            Checkpoint(state=state).restore(shared_dir)
        assert state.value == 100 + strategy.rank
    if size == 1:
        return
    with group(size - 1) as strategy:
        if strategy is not None:
            state = PerRankState(-1)
            with strategy.scope(), pytest.raises(ValueError, match=f"different state on each of {size} ranks"):
                Checkpoint(state=state).restore(shared_dir)
            assert state.value == -1


def refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def same_json(a, b) -> bool:
    """Equal, NaN counting as equal to NaN (and told apart from None)."""
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_iterator_states_with_nan_and_infinities_restore_exactly_from_a_strict_json_manifest(shared_dir):
    size = WORLD.size
    nan, inf = float("nan"), float("inf")
    alike = {"loss": nan, "best": inf, "worst": -inf, "history": [1.5, nan, [None, -inf]], "none": None, "text": "NaN"}
    mine = {"rank": WORLD.rank, "loss": nan if WORLD.rank == 0 else float(WORLD.rank)}  # differs between ranks
    with group(size) as strategy:
        with strategy.scope():
            saved = Checkpoint(alike=Statistics(alike), mine=Statistics(mine)).save(shared_dir)
        text = (Path(saved) / fmt.MANIFEST).read_text()
        manifest = json.loads(text, parse_constant=refuse_constant)  # strict JSON: no NaN, Infinity
        entries = {e["name"]: e for e in manifest["entries"]}
        assert "state" in entries["alike"]  # NaN on every rank is the same state, saved once
        assert ("state" in entries["mine"]) == (size == 1)
        assert manifest["format_version"] == 3
        restored = Statistics(None), Statistics(None)
        with strategy.scope():
            Checkpoint(alike=restored[0], mine=restored[1]).restore(shared_dir)
        assert same_json(restored[0].state, alike) and same_json(restored[1].state, mine)
        assert not same_json(restored[0].state, {**alike, "loss": None})  # the comparison tells NaN from None
    if size == 1:
        return
    with group(size - 1) as strategy:  # a state alike on every rank restores on another number of ranks
        if strategy is not None:
            restored = Statistics(None)
            with strategy.scope():
                Checkpoint(alike=restored).restore(shared_dir)
            assert same_json(restored.state, alike)


def test_keep_and_restore_of_an_older_save(strategy, shared_dir):
    with strategy.scope():
        step = mpidist.Variable(np.zeros((), np.int64), name="step")
    checkpoint = Checkpoint(step=step)
    for k in range(1, 5):
        with strategy.scope():
            step.assign(np.array(k))
        checkpoint.save(shared_dir, keep=2)
    assert [v.name for v in fmt.list_versions(shared_dir)] == ["ckpt-000003", "ckpt-000004"]
    checkpoint.restore(shared_dir / "ckpt-000003")
    assert int(components(step)) == 3


def test_save_is_a_cross_replica_call(strategy, shared_dir):
    with strategy.scope():
        weights = mpidist.Variable(np.zeros(2))
    checkpoint = Checkpoint(weights=weights)
    with pytest.raises(RuntimeError, match=r"outside strategy\.run"):
        strategy.run(lambda: checkpoint.save(shared_dir))
    with pytest.raises(RuntimeError, match=r"inside `with strategy\.scope"):
        Checkpoint(table=np.zeros(2)).save(shared_dir)
    with pytest.raises(TypeError, match="'name' is a str"):
        Checkpoint(name="text")


@pytest.mark.gpu
def test_gpu_components_save_and_restore(shared_dir):
    s = mpidist.MPIStrategy(device="gpu")
    try:
        model = build(s, fill=True)
        Checkpoint(**model).save(shared_dir, block_bytes=32)
        model = build(s, fill=False)
        assert type(model["weights"].values[0]).__module__.startswith("cupy")
        Checkpoint(**model).restore(shared_dir)
        for name in ("weights", "total", "count", "mean", "first"):
            model[name] = _HostView(model[name])
        check_restored(s, model, s.num_replicas_in_sync)
    finally:
        s.free()


class _HostView:
    """A variable whose ``values`` are host copies (for comparisons) and which still reads collectively."""

    def __init__(self, variable) -> None:
        self._variable = variable
        self.values = (variable.values[0].get(),)

    def numpy(self):
        return self._variable.numpy()


# -- mirrored variables whose components diverged ------------------------------------------------
def diverged_model(strategy) -> dict:
    """Mirrored variables whose component on rank r is filled with r + 1 (diverged when n > 1)."""
    r = strategy.rank
    with strategy.scope():
        model = {
            "one": mpidist.Variable(np.zeros(1), name="one"),
            "large": mpidist.Variable(np.zeros(1000, np.float32), name="large"),
            "same": mpidist.Variable(np.arange(7.0), name="same"),
        }
    for name in ("one", "large"):
        model[name].values[0][...] = r + 1
    return model


def test_a_diverged_mirrored_variable_is_saved_as_rank_0s_value(strategy, shared_dir):
    model = diverged_model(strategy)
    Checkpoint(**model).save(shared_dir, block_bytes=32, check_mirrors=False)
    arrays = read_checkpoint(shared_dir)
    np.testing.assert_array_equal(arrays["one"], np.ones(1))
    np.testing.assert_array_equal(arrays["large"], np.ones(1000, np.float32))
    np.testing.assert_array_equal(arrays["same"], np.arange(7.0))
    assert (components(model["large"]) == strategy.rank + 1).all()  # saving changed no component
    Checkpoint(**model).restore(shared_dir)
    assert (components(model["one"]) == 1).all() and (components(model["large"]) == 1).all()


def test_the_mirror_check_raises_on_every_rank_naming_variables_and_ranks(strategy, shared_dir):
    n = strategy.num_replicas_in_sync
    model = diverged_model(strategy)
    if n == 1:  # one component cannot diverge: the save goes through
        Checkpoint(**model).save(shared_dir, block_bytes=32)
        np.testing.assert_array_equal(read_checkpoint(shared_dir)["large"], np.ones(1000, np.float32))
        return
    with pytest.raises(mpidist.MirrorDivergenceError) as info:
        Checkpoint(**model).save(shared_dir, block_bytes=32)
    others = tuple(range(1, n))
    assert info.value.diverged == {"one": others, "large": others}
    ranks = "rank 1" if n == 2 else f"ranks 1-{n - 1}"
    assert f"mirrored variable 'large' differs from rank 0's on {ranks}" in str(info.value)
    assert f"mirrored variable 'one' differs from rank 0's on {ranks}" in str(info.value)
    assert "'same'" not in str(info.value)
    assert not shared_dir.exists() or not list(shared_dir.iterdir())  # nothing was written
    # only the last rank differs
    model["one"].values[0][...] = 1.0 if strategy.rank < n - 1 else 5.0
    model["large"].values[0][...] = 1.0
    with pytest.raises(mpidist.MirrorDivergenceError, match=f"'one' differs from rank 0's on rank {n - 1} "):
        Checkpoint(**model).save(shared_dir, block_bytes=32)


# -- files that are not regular files, in a collective restore ------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "manifest-symlink"])
def test_restore_refuses_other_files_than_regular_ones_on_every_rank(strategy, shared_dir, kind):
    model = build(strategy, fill=True)
    Checkpoint(**model).save(shared_dir, block_bytes=32)
    save = shared_dir / "ckpt-000001"
    if WORLD.rank == 0:
        weights = next(save.glob("*weights.npy"))
        target = save / fmt.MANIFEST if kind == "manifest-symlink" else weights
        outside = shared_dir.parent / "outside"
        shutil.copy(target, outside)
        target.unlink()
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "directory":
            target.mkdir()
        else:
            target.symlink_to(outside)
    WORLD.Barrier()
    model = build(strategy, fill=False)
    expected = {"fifo": "is a FIFO", "directory": "is a directory"}.get(kind, "is a symbolic link")
    with pytest.raises(mpidist.CheckpointError, match=f"rank 0: .*{expected}, not a regular file") as info:
        Checkpoint(**model).restore(shared_dir)
    assert "nothing was modified" in str(info.value)
    assert (components(model["weights"]) == 0).all() and model["inputs"].position == 0
    with pytest.raises(mpidist.CheckpointError, match=expected):
        read_checkpoint(shared_dir)


@pytest.mark.parametrize("node_size", [1, 2])
def test_restore_reads_each_byte_once_per_node_and_gathers_within_it(shared_dir, monkeypatch, node_size):
    """Ranks grouped into "nodes" of ``node_size``: each node's ranks read disjoint parts that together
    cover every byte once, and the values arrive intact on every rank (host arrays in place)."""
    strategy = mpidist.MPIStrategy(device="cpu", node_size=node_size)
    try:
        rank, size = strategy.rank, strategy.num_replicas_in_sync
        with strategy.scope():
            w = mpidist.Variable(np.arange(3000, dtype=np.float64) * (rank == 0), name="w")  # rank 0's is broadcast
            m = mpidist.Variable(np.full((5, 7), 2, np.int32), name="m", synchronization="on_read", aggregation="sum")
        plain = np.arange(1000, dtype=np.int16)
        Checkpoint(w=w, m=m, plain=plain).save(shared_dir, block_bytes=1024)
        with strategy.scope():
            w.assign(np.zeros(3000))
            m.assign(np.zeros((5, 7), np.int32))
        plain[...] = 0
        component = np.asarray(w)
        read: list[tuple[str, int, int]] = []
        original = reader.Save.read

        def recording(self, pieces, threads, verify=True):
            read.extend((p.entry["name"], p.lo, p.hi) for p in pieces)
            return original(self, pieces, threads, verify)

        monkeypatch.setattr(reader.Save, "read", recording)
        for _ in range(2):
            Checkpoint(w=w, m=m, plain=plain).restore(shared_dir)
            np.testing.assert_array_equal(w.numpy(), np.arange(3000, dtype=np.float64))
            assert np.asarray(w) is component  # the component was filled in place
            with strategy.scope():
                np.testing.assert_array_equal(m.read_value(), np.full((5, 7), 2 * size, np.int32))
            np.testing.assert_array_equal(plain, np.arange(1000, dtype=np.int16))
        reads = strategy.comm.allgather(read[: len(read) // 2])  # the first restore's reads
        group = node_size if node_size < size else size
        sizes = {"w": 3000 * 8, "m": 35 * 4, "plain": 2000}
        for first in range(0, size, group):
            node = range(first, min(first + group, size))
            for name, nbytes in sizes.items():
                spans = sorted((lo, hi) for r in node for n, lo, hi in reads[r] if n == name and hi > lo)
                assert spans[0][0] == 0 and spans[-1][1] == nbytes, (name, spans)
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)  # disjoint, no gaps
    finally:
        strategy.free()


# -- a save or restore that fails, or is left midway, on one rank (whole jobs: test_checkpoint_interrupted.py) --
class Interrupt(BaseException):
    """Not an ``Exception``, as ``KeyboardInterrupt`` (which pytest itself would act on)."""


def fail_once(monkeypatch, owner, attribute: str, error: BaseException, when=None) -> None:
    """``owner.attribute`` raises ``error`` at its first call for which ``when(*args)`` holds (any call, without)."""
    real = getattr(owner, attribute)

    def fault(*args, **kwargs):
        if when is None or when(*args, **kwargs):
            monkeypatch.setattr(owner, attribute, real)
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, fault)


@pytest.fixture
def quick():
    """A strategy whose deadline (10 s) ends any wait that the tests below do not expect."""
    s = mpidist.MPIStrategy(device="cpu", timeout=10)
    yield s
    s.free()


def saved_model(strategy, shared_dir: Path) -> tuple[Checkpoint, dict]:
    """Save 1 of a mirrored variable (all 1.0) and an input position (7); then the variable set to 2.0."""
    with strategy.scope():
        weights = mpidist.Variable(np.ones(40), name="weights")
    inputs = ShardedRange(strategy.rank, strategy.num_replicas_in_sync)
    inputs.position = 7
    checkpoint = Checkpoint(weights=weights, inputs=inputs)
    checkpoint.save(shared_dir, block_bytes=32)  # every rank writes a share
    with strategy.scope():
        weights.assign(np.full(40, 2.0))
    return checkpoint, {"weights": weights, "inputs": inputs}


def only_save_1(shared_dir: Path) -> None:
    """Collective over the world: save 1 is intact and the newest, and no temporary directory is left."""
    WORLD.Barrier()
    assert sorted(p.name for p in shared_dir.iterdir()) == ["ckpt-000001"]
    assert (read_checkpoint(shared_dir)["weights"] == 1.0).all()


@pytest.mark.parametrize("step", ["items", "write", "commit"])
def test_an_interrupt_in_a_save_step_on_one_rank_ends_that_save_on_every_rank(quick, shared_dir, monkeypatch, step):
    n, r = quick.num_replicas_in_sync, quick.rank
    checkpoint, model = saved_model(quick, shared_dir)
    failing = 0 if step == "commit" else n - 1
    if r == failing:
        where = {"items": (model["inputs"], "get_state"), "write": (fmt, "write_pieces"), "commit": (fmt, "commit")}
        fail_once(monkeypatch, *where[step], Interrupt("stop"))
    with pytest.raises(Interrupt if r == failing else mpidist.CheckpointError) as info:
        checkpoint.save(shared_dir, block_bytes=32)
    if r != failing:  # told in the same step, by the failing rank
        assert str(info.value).startswith(f"rank {r}: Checkpoint.save to {shared_dir} failed, the saves already")
        assert str(info.value).endswith(f"rank {failing}: Interrupt: stop")
    only_save_1(shared_dir)
    assert checkpoint.save(shared_dir, block_bytes=32) == str(shared_dir / "ckpt-000002")
    assert (read_checkpoint(shared_dir)["weights"] == 2.0).all()


@pytest.mark.parametrize("step", ["read", "states"])
def test_an_interrupt_in_a_restore_step_on_one_rank_modifies_nothing(quick, shared_dir, monkeypatch, step):
    n, r = quick.num_replicas_in_sync, quick.rank
    checkpoint, model = saved_model(quick, shared_dir)
    model["inputs"].position = 0
    if r == n - 1:
        where = {"read": (reader.Save, "read"), "states": (model["inputs"], "set_state")}
        fail_once(monkeypatch, *where[step], Interrupt("stop"))
    with pytest.raises(Interrupt if r == n - 1 else mpidist.CheckpointError) as info:
        checkpoint.restore(shared_dir)
    if r != n - 1:
        assert str(info.value).endswith(f"nothing was modified: rank {n - 1}: Interrupt: stop")
    assert (components(model["weights"]) == 2.0).all() and model["inputs"].position == 0
    checkpoint.restore(shared_dir)
    assert (components(model["weights"]) == 1.0).all() and model["inputs"].position == 7


@pytest.mark.parametrize("operation", ["save", "restore"])
def test_ranks_in_different_steps_raise_a_mismatch_naming_both_steps(quick, shared_dir, monkeypatch, operation):
    """The last rank leaves a step in the middle of its collective (as an interrupt there would), then calls
    again: its new call meets the others still in the step it left, and every rank raises."""
    n, r = quick.num_replicas_in_sync, quick.rank
    if n == 1:
        pytest.skip("needs two ranks to be in different steps")
    checkpoint, model = saved_model(quick, shared_dir)
    model["inputs"].position = 0
    left, again = {
        "save": ("Checkpoint.save 3/4: write", "Checkpoint.save 1/4: items and arguments"),
        "restore": ("Checkpoint.restore 3/4: read", "Checkpoint.restore 1/4: manifest"),
    }[operation]

    def call() -> str:
        return checkpoint.save(shared_dir, block_bytes=32) if operation == "save" else checkpoint.restore(shared_dir)

    if r == n - 1:
        fail_once(monkeypatch, quick.communicator, "outcome", Interrupt("stop"), lambda error, name: name == left)
        with pytest.raises(Interrupt):
            call()
    with pytest.raises(mpidist.CollectiveMismatchError) as info:
        call()  # the others' first call, the last rank's second
    others = "rank 0" if n == 2 else f"ranks 0-{n - 2}"
    assert f"{others}: #" in str(info.value) and f"'{left} (outcome)'" in str(info.value)
    assert f"rank {n - 1}: #" in str(info.value) and f"'{again} (outcome)'" in str(info.value)
    only_save_1(shared_dir)
    assert (components(model["weights"]) == 2.0).all() and model["inputs"].position == 0  # nothing was modified
    call()  # every rank calls together again: it works
    if operation == "save":
        assert (read_checkpoint(shared_dir)["weights"] == 2.0).all()
    else:
        assert (components(model["weights"]) == 1.0).all() and model["inputs"].position == 7


# -- bfloat16 -------------------------------------------------------------------------------------------
ALL_BITS = np.arange(1 << 16, dtype=np.uint16)  # every bfloat16: zeros, subnormals, infinities, NaN payloads
# Totals of a SUM variable, 6 * k * 2**e with |k| < 22 (at most 8 significant bits): they and their shares at 1,
# 2 and 3 ranks hold exactly in bfloat16, so the shares a restore sets add up to the saved total bit for bit.
TOTALS = np.array([6 * k * 2.0**e for k, e in [(1, 0), (21, -3), (-13, 40), (5, -60), (-7, 7), (0, 0)]])
MEANS = np.array([0.1, -7.5, 2.0**-120, 1e30])  # the same on every rank: their MEAN is themselves
FIRST = np.array([0x7FC1, 0xFFFF, 0x8000, 0x0001, 0x7F80], np.uint16)  # NaN payloads, -0, a subnormal, inf


@pytest.fixture
def bfloat16():
    return np.dtype(pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes").bfloat16)


def bfloat16_model(strategy, bfloat16, fill: bool) -> dict:
    """bfloat16 items: every bit pattern as a mirrored variable and (rank 0's) as an array, sync-on-read SUM,
    MEAN and ONLY_FIRST_REPLICA variables; with ``fill`` their values, else zeros."""
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        on_read = dict(synchronization=mpidist.VariableSynchronization.ON_READ)
        model = dict(
            weights=mpidist.Variable((ALL_BITS if fill else np.zeros_like(ALL_BITS)).view(bfloat16)),
            total=mpidist.Variable(np.zeros(len(TOTALS), bfloat16), aggregation="sum", **on_read),
            mean=mpidist.Variable(np.zeros(len(MEANS), bfloat16), aggregation="mean", **on_read),
            first=mpidist.Variable(np.zeros(len(FIRST), bfloat16), aggregation="only_first_replica", **on_read),
        )
    model["table"] = (ALL_BITS[::-1] if fill and r == 0 else np.zeros_like(ALL_BITS)).view(bfloat16)
    if fill:

        def step():
            model["total"].assign((TOTALS / n).astype(bfloat16))
            model["mean"].assign(MEANS.astype(bfloat16))
            model["first"].assign((FIRST if r == 0 else FIRST + r).view(bfloat16))  # only rank 0's is saved

        strategy.run(step)
    return model


def bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint16)


def check_bfloat16_restored(strategy, model: dict, bfloat16) -> None:
    """The values of :func:`bfloat16_model`, bit for bit, after a restore on this strategy's ranks."""
    n = strategy.num_replicas_in_sync
    assert all(components(model[name]).dtype == bfloat16 for name in ("weights", "total", "mean", "first"))
    assert (bits(components(model["weights"])) == ALL_BITS).all()
    assert (bits(model["table"]) == ALL_BITS[::-1]).all()
    assert (bits(components(model["total"])) == bits((TOTALS / n).astype(bfloat16))).all()
    assert (bits(components(model["mean"])) == bits(MEANS.astype(bfloat16))).all()
    assert (bits(components(model["first"])) == FIRST).all()
    with strategy.scope():  # what the variables read as is what was saved
        assert (bits(model["total"].numpy()) == bits(TOTALS.astype(bfloat16))).all()
        assert (bits(model["first"].numpy()) == FIRST).all()


@pytest.mark.parametrize("block_bytes", [32, fmt.BLOCK_BYTES])
@pytest.mark.parametrize("saved_at,restored_at", [(a, b) for a in (1, 2, 3) for b in (1, 2, 3)])
def test_bfloat16_restores_bit_for_bit_on_any_number_of_ranks(shared_dir, bfloat16, saved_at, restored_at, block_bytes):
    needs(saved_at, restored_at)
    with group(saved_at) as strategy:
        if strategy is not None:
            Checkpoint(**bfloat16_model(strategy, bfloat16, fill=True)).save(shared_dir, block_bytes=block_bytes)
    with group(restored_at) as strategy:
        if strategy is not None:
            model = bfloat16_model(strategy, bfloat16, fill=False)
            Checkpoint(**model).restore(shared_dir)
            check_bfloat16_restored(strategy, model, bfloat16)
    if WORLD.rank == 0:  # the files, read without MPI: by mpidist, and as uint16 bits by NumPy alone
        save = shared_dir / "ckpt-000001"
        manifest = json.loads((save / fmt.MANIFEST).read_text())
        assert manifest["world_size"] == saved_at and manifest["format_version"] == 2
        assert {e["dtype"] for e in manifest["entries"]} == {"bfloat16"}
        arrays = read_checkpoint(shared_dir)
        assert arrays["weights"].dtype == bfloat16 and (bits(arrays["weights"]) == ALL_BITS).all()
        assert (bits(arrays["total"]) == bits(TOTALS.astype(bfloat16))).all()
        loaded = np.load(next(save.glob("*-weights.npy")), allow_pickle=False)
        assert loaded.dtype == np.dtype("<u2") and (loaded == ALL_BITS).all()


@pytest.mark.gpu
def test_bfloat16_device_components_save_and_restore(shared_dir, bfloat16):
    s = mpidist.MPIStrategy(device="gpu")
    try:
        Checkpoint(**bfloat16_model(s, bfloat16, fill=True)).save(shared_dir, block_bytes=32)
        model = bfloat16_model(s, bfloat16, fill=False)
        assert type(model["weights"].values[0]).__module__.startswith("cupy")
        Checkpoint(**model).restore(shared_dir)
        for name in ("weights", "total", "mean", "first"):
            model[name] = _HostView(model[name])
        check_bfloat16_restored(s, model, bfloat16)
    finally:
        s.free()


def test_bfloat16_and_float32_do_not_match_on_any_rank(strategy, shared_dir, bfloat16, monkeypatch):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        half = mpidist.Variable(np.full(5, 1.5, bfloat16), name="half")
        single = mpidist.Variable(np.full(5, 7, np.float32), name="single")
    Checkpoint(w=half).save(shared_dir / "half")
    Checkpoint(w=single).save(shared_dir / "single")
    with pytest.raises(ValueError, match="'w' has dtype float32 in the checkpoint but bfloat16 here") as info:
        Checkpoint(w=half).restore(shared_dir / "single")
    assert str(info.value).startswith(f"rank {r}: ") and "nothing was modified" in str(info.value)
    if r == n - 1:  # this rank has no ml_dtypes: only its message says why, but every rank raises
        monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(ValueError, match="'w' has dtype bfloat16 in the checkpoint but float32 here") as info:
        Checkpoint(w=single).restore(shared_dir / "half")
    last = "rank 0" if n == 1 else f"rank {n - 1}"
    others = "" if n == 1 else "rank 0: " if n == 2 else f"ranks 0-{n - 2}: "
    assert f"{last}: ValueError: " in str(info.value) and f"{others}ValueError: " in str(info.value)
    assert (
        str(info.value).count("(bfloat16 needs ml_dtypes, which is not installed: pip install 'mpidist[bfloat16]')")
        == 1
    )
    assert (components(half) == 1.5).all() and (components(single) == 7).all()
