"""Checkpoint format, checksums, atomicity and the inspect command, without an MPI test run.

Checkpoints are written in this process by a one-rank strategy over COMM_SELF; the
atomicity tests start real ``mpiexec`` jobs (tests/helpers/samples/checkpoint_save_job.py) and kill
their ranks with SIGKILL in the middle of a save.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

import mpidist
from mpidist._checkpoint import format as fmt
from mpidist._checkpoint.checkpoint import Checkpoint, read_checkpoint
from mpidist._checkpoint.reader import Save, inspect
from mpidist._errors import CheckpointError, ChecksumError
from mpidist._tools.cli import main as cli
from mpirun import run_mpi
from paths import SAMPLES
from states import Statistics

JOB = SAMPLES / "checkpoint_save_job.py"
TIMEOUT = 60


class Position:
    """Iterator-like test object: get_state/set_state of a JSON dict."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def get_state(self) -> dict:
        return {"position": self.position, "epoch": 2}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


@pytest.fixture(scope="module")
def strategy():
    from mpi4py import MPI

    s = mpidist.MPIStrategy(comm=MPI.COMM_SELF, device="cpu")
    yield s
    s.free()


EXPECTED = {
    "weights": np.arange(15, dtype=np.float32).reshape(3, 5) / 7,
    "counter": np.array([3, -4, 5], dtype=np.int64),
    "table": np.arange(12, dtype=np.int16).reshape(2, 3, 2),
    "empty": np.zeros((0, 4), np.float64),
}


def make_checkpoint(strategy, path, block_bytes=32, **save_options):
    """Save EXPECTED (plus a Position at 7) into ``path``; returns the Checkpoint and the save's directory."""
    with strategy.scope():
        weights = mpidist.Variable(EXPECTED["weights"], name="weights")
        counter = mpidist.Variable(EXPECTED["counter"], name="counter", synchronization="on_read", aggregation="sum")
    checkpoint = Checkpoint(
        weights=weights,
        counter=counter,
        table=EXPECTED["table"].copy(),
        empty=EXPECTED["empty"].copy(),
        position=Position(7),
    )
    return checkpoint, Path(checkpoint.save(path, block_bytes=block_bytes, **save_options))


def assert_expected(arrays):
    assert sorted(arrays) == sorted(EXPECTED)
    for name, value in EXPECTED.items():
        assert arrays[name].dtype == value.dtype and arrays[name].shape == value.shape, name
        np.testing.assert_array_equal(arrays[name], value)


def data_file(save_dir, name):
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    entry = next(e for e in manifest["entries"] if e["name"] == name)
    return save_dir / entry["file"], entry


# -- work split ------------------------------------------------------------------------------
@given(
    sizes=st.lists(st.integers(0, 3000), max_size=7),
    nranks=st.integers(1, 9),
    block=st.sampled_from([1, 8, 64, 1000]),
    alone=st.lists(st.booleans(), min_size=7, max_size=7),
)
def test_share_ranges_cover_each_entry_in_rank_order_and_balance(sizes, nranks, block, alone):
    alone = alone[: len(sizes)]
    ranges = fmt.share_ranges(sizes, nranks, block, rank0_only=alone)
    assert len(ranges) == len(sizes)
    per_rank = [0] * nranks
    for size, fixed, shares in zip(sizes, alone, ranges):
        assert len(shares) == nranks
        assert shares[0][0] == 0 and shares[-1][1] == size
        for (lo, hi), (next_lo, _) in zip(shares, shares[1:]):
            assert lo <= hi == next_lo
        for lo, hi in shares:
            assert lo == size or lo % block == 0
            assert lo <= hi
        if fixed:
            assert shares[0] == (0, size)
        else:
            for r, (lo, hi) in enumerate(shares):
                per_rank[r] += hi - lo
    total = sum(s for s, f in zip(sizes, alone) if not f)
    assert sum(per_rank) == total
    assert max(per_rank) <= total / nranks + block


def test_share_ranges_spread_one_large_array_evenly():
    ranges = fmt.share_ranges([256 << 20], 3, 8 << 20)[0]
    sizes = [hi - lo for lo, hi in ranges]
    assert sum(sizes) == 256 << 20 and max(sizes) - min(sizes) <= 8 << 20


# -- files a plain NumPy reads ----------------------------------------------------------------
def test_files_are_plain_npy_and_the_manifest_plain_json(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    assert save_dir == tmp_path / "ckpt" / "ckpt-000001"
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    assert manifest["world_size"] == 1 and manifest["checksum"] == "crc32" and manifest["format_version"] == 1
    entries = {e["name"]: e for e in manifest["entries"]}
    assert entries["position"] == {"name": "position", "kind": "state", "state": {"position": 7, "epoch": 2}}
    assert entries["counter"]["aggregation"] == "sum" and entries["counter"]["kind"] == "sync_on_read"
    assert entries["weights"]["kind"] == "mirrored" and entries["table"]["kind"] == "array"
    for name, value in EXPECTED.items():
        path = save_dir / entries[name]["file"]
        assert entries[name]["shape"] == list(value.shape) and np.dtype(entries[name]["dtype"]) == value.dtype
        loaded = np.load(path, allow_pickle=False)
        np.testing.assert_array_equal(loaded, value)
        assert loaded.dtype == value.dtype
        data = path.read_bytes()[entries[name]["data_offset"] :]
        block = manifest["chunk_bytes"]  # the on-disk key names of format 1, kept for every reader
        assert entries[name]["chunk_crc32"] == [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]


def test_save_accepts_the_former_name_of_block_bytes(strategy, tmp_path):
    checkpoint, _ = make_checkpoint(strategy, tmp_path / "ckpt")
    save_dir = Path(checkpoint.save(tmp_path / "ckpt", chunk_bytes=64))
    assert json.loads((save_dir / fmt.MANIFEST).read_text())["chunk_bytes"] == 64
    with pytest.raises(ValueError, match="chunk_bytes is the former name of block_bytes"):
        checkpoint.save(tmp_path / "ckpt", block_bytes=64, chunk_bytes=64)
    with pytest.raises(ValueError, match=r"block_bytes must be a positive multiple of 32 .*got 48"):
        checkpoint.save(tmp_path / "ckpt", block_bytes=48)


def test_read_checkpoint_returns_every_array_without_a_strategy(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    assert_expected(read_checkpoint(tmp_path / "ckpt"))
    assert_expected(read_checkpoint(save_dir))
    assert_expected(read_checkpoint(save_dir, verify=False))


def test_loading_never_unpickles(strategy, tmp_path, monkeypatch):
    checkpoint, _ = make_checkpoint(strategy, tmp_path / "ckpt")

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    real_load = np.load

    def numpy_load(*args, **kwargs):
        assert kwargs.get("allow_pickle") is False
        return real_load(*args, **kwargs)

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(np, "load", numpy_load)
    assert_expected(read_checkpoint(tmp_path / "ckpt"))
    assert_expected(read_checkpoint(tmp_path / "ckpt", verify=False))
    position = checkpoint.items["position"]
    position.position = 0
    checkpoint.items["table"][...] = 0
    checkpoint.restore(tmp_path / "ckpt")
    assert position.position == 7
    np.testing.assert_array_equal(checkpoint.items["table"], EXPECTED["table"])


class _Payload:
    """Unpickling this creates a marker file: proof that code from a file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_manifest_asking_for_object_arrays_is_refused_before_any_code_runs(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    path, _ = data_file(save_dir, "table")
    np.save(path, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    for e in manifest["entries"]:
        if e["name"] == "table":
            e.update(dtype="|O", shape=[1], nbytes=8, chunk_crc32=[0])
    (save_dir / fmt.MANIFEST).write_bytes(fmt.encode_manifest(manifest))  # a consistent, hostile manifest
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=r"malformed manifest.*'dtype' has an unusable value '\|O'") as info:
            read_checkpoint(save_dir, verify=verify)
        assert not isinstance(info.value, ChecksumError)
    assert not marker.exists()


def test_a_data_file_replaced_by_a_pickle_is_a_checksum_error(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    path, _ = data_file(save_dir, "weights")
    np.save(path, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ChecksumError, match="weights"):
        read_checkpoint(save_dir)
    with pytest.raises(ChecksumError, match="weights"):
        read_checkpoint(save_dir, verify=False)  # sizes and headers are still checked
    assert not marker.exists()


def test_a_file_name_outside_the_save_is_refused(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    manifest["entries"][0]["file"] = "../../outside.npy"
    (save_dir / fmt.MANIFEST).write_bytes(fmt.encode_manifest(manifest))
    with pytest.raises(CheckpointError, match=r"malformed manifest.*field 'file'"):
        read_checkpoint(save_dir)


# -- damage is detected and named ----------------------------------------------------------------
def test_a_flipped_byte_is_a_checksum_error_naming_file_and_variable(strategy, tmp_path, capsys):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    path, entry = data_file(save_dir, "weights")
    data = bytearray(path.read_bytes())
    data[entry["data_offset"] + 41] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError) as info:
        read_checkpoint(tmp_path / "ckpt")
    assert str(path) in str(info.value) and "'weights'" in str(info.value) and "block 1" in str(info.value)
    assert info.value.file == str(path) and info.value.entry == "weights"
    report = inspect(tmp_path / "ckpt")
    assert not report.ok and list(report.problems) == ["weights"]
    assert cli(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and str(path) in out


def test_a_truncated_file_is_detected(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    path, entry = data_file(save_dir, "table")
    os.truncate(path, entry["data_offset"] + entry["nbytes"] - 3)
    with pytest.raises(ChecksumError, match=r"table.*(truncated|bytes, expected)"):
        read_checkpoint(save_dir)


def test_a_damaged_header_is_detected(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    path, _ = data_file(save_dir, "counter")
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="header of 'counter'"):
        read_checkpoint(save_dir)


def test_an_altered_or_missing_file_is_detected(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    manifest_path = save_dir / fmt.MANIFEST
    original = manifest_path.read_text()
    manifest_path.write_text(original.replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(ChecksumError, match=r"manifest\.json.*does not match its checksum"):
        read_checkpoint(save_dir)
    manifest_path.write_text(original[: len(original) // 2])
    with pytest.raises(ChecksumError, match="not a valid manifest"):
        read_checkpoint(save_dir)
    manifest_path.write_text(original)
    path, _ = data_file(save_dir, "table")
    path.unlink()
    with pytest.raises(ChecksumError, match="missing"):
        read_checkpoint(save_dir)


def test_restore_checks_before_it_modifies(strategy, tmp_path):
    checkpoint, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    path, _ = data_file(save_dir, "weights")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    table, position = checkpoint.items["table"], checkpoint.items["position"]
    table[...] = -1
    position.position = -1
    with pytest.raises(ChecksumError, match=r"nothing was modified.*weights"):
        checkpoint.restore(tmp_path / "ckpt")
    assert (table == -1).all() and position.position == -1


def test_restores_reuse_one_share_buffer_and_still_check_before_modifying(strategy, tmp_path):
    checkpoint, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    table, weights = checkpoint.items["table"], checkpoint.items["weights"]
    checkpoint.restore(tmp_path / "ckpt")
    buffer = checkpoint._share_buffer
    table[...] = -1
    checkpoint.restore(tmp_path / "ckpt")
    assert checkpoint._share_buffer is buffer  # no new memory for the second restore
    np.testing.assert_array_equal(table, EXPECTED["table"])
    np.testing.assert_array_equal(weights.numpy(), EXPECTED["weights"])
    path, _ = data_file(save_dir, "weights")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    table[...] = -1
    with strategy.scope():
        weights.assign(np.zeros_like(EXPECTED["weights"]))
    with pytest.raises(ChecksumError, match=r"nothing was modified.*weights"):
        checkpoint.restore(tmp_path / "ckpt")
    assert (table == -1).all() and (weights.numpy() == 0).all()


# -- saves, keep, leftovers ------------------------------------------------------------------------
def test_keep_the_newest_saves_and_read_older_ones(strategy, tmp_path):
    table = np.zeros(4, np.int32)
    checkpoint = Checkpoint(table=table)
    with strategy.scope():
        for k in range(1, 5):
            table[...] = k
            checkpoint.save(tmp_path / "ckpt", keep=2)
    versions = fmt.list_versions(tmp_path / "ckpt")
    assert [v.name for v in versions] == ["ckpt-000003", "ckpt-000004"]
    assert (read_checkpoint(tmp_path / "ckpt")["table"] == 4).all()
    assert (read_checkpoint(versions[0])["table"] == 3).all()
    with strategy.scope():
        checkpoint.restore(versions[0])
    assert (table == 3).all()


def test_leftovers_of_a_killed_save_are_ignored_then_removed(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    leftover = tmp_path / "ckpt" / ".tmp-ckpt-000002-deadbeef"
    leftover.mkdir()
    (leftover / "0000-weights.npy").write_bytes(b"partial")
    with Save.open(tmp_path / "ckpt") as save:
        assert save.directory == save_dir
    assert_expected(read_checkpoint(tmp_path / "ckpt"))
    _, newer = make_checkpoint(strategy, tmp_path / "ckpt", keep=5)
    assert newer.name == "ckpt-000003" and not leftover.exists()


def test_a_newest_save_without_its_manifest_is_damage_not_a_reason_to_go_back(strategy, tmp_path):
    # a save appears only with its manifest: one that lost it was damaged (or is being copied in),
    # and restoring the save before it instead would silently repeat the steps in between
    checkpoint, older = make_checkpoint(strategy, tmp_path / "ckpt", keep=5)
    _, newest = make_checkpoint(strategy, tmp_path / "ckpt", keep=5)
    (newest / fmt.MANIFEST).unlink()
    missing = rf"{newest / fmt.MANIFEST} is missing: the save was damaged"
    with pytest.raises(ChecksumError, match=missing):
        read_checkpoint(tmp_path / "ckpt")
    table = checkpoint.items["table"]
    table[...] = -1
    with strategy.scope(), pytest.raises(ChecksumError, match=rf"nothing was modified.*{missing}"):
        checkpoint.restore(tmp_path / "ckpt")
    assert (table == -1).all()
    assert cli(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 1
    assert cli(["checkpoint", "inspect", str(newest)]) == 1  # named itself, it is the same damaged save
    with pytest.raises(ChecksumError, match=missing):
        read_checkpoint(newest)
    with strategy.scope():
        assert checkpoint.restore(older) == str(older)  # going back is the caller's choice
    assert (table == EXPECTED["table"]).all()
    _, newer = make_checkpoint(strategy, tmp_path / "ckpt", keep=1)
    assert fmt.list_versions(tmp_path / "ckpt") == [newer]  # the damaged save is pruned as an old one


def test_save_refuses_a_directory_that_is_not_a_checkpoint(strategy, tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    with strategy.scope(), pytest.raises(CheckpointError, match=r"notes\.txt"):
        Checkpoint(table=np.zeros(2)).save(tmp_path / "results")
    assert (tmp_path / "results" / "notes.txt").read_text() == "mine"


def test_restore_of_a_missing_checkpoint_is_file_not_found(strategy, tmp_path):
    with strategy.scope(), pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpoint(table=np.zeros(2)).restore(tmp_path / "nothing")


# -- the inspect command ----------------------------------------------------------------------------
def test_inspect_lists_names_shapes_dtypes_world_size_and_verifies(strategy, tmp_path, capsys):
    make_checkpoint(strategy, tmp_path / "ckpt")
    assert cli(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "on 1 rank;" in out and "every checksum matches" in out
    for text in (
        "weights",
        "mirrored",
        "(3, 5)",
        "float32",
        "counter",
        "sync_on_read",
        "sum",
        "int64",
        "table",
        "(2, 3, 2)",
        "int16",
        "position",
        '"position": 7',
    ):
        assert text in out, text
    assert cli(["checkpoint", "inspect", "--json", "--no-verify", str(tmp_path / "ckpt")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and not report["verified"] and report["manifest"]["world_size"] == 1


def test_inspect_all_and_exit_statuses(strategy, tmp_path, capsys):
    make_checkpoint(strategy, tmp_path / "ckpt", keep=3)
    make_checkpoint(strategy, tmp_path / "ckpt", keep=3)
    assert cli(["checkpoint", "inspect", "--all", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.count("checkpoint ") == 2
    assert cli(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 3
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli(["checkpoint"])
    assert exit_info.value.code == 2


def test_python_m_mpidist_checkpoint_inspect(strategy, tmp_path):
    _, save_dir = make_checkpoint(strategy, tmp_path / "ckpt")
    run = [sys.executable, "-m", "mpidist", "checkpoint", "inspect"]
    ok = subprocess.run([*run, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=TIMEOUT)
    assert ok.returncode == 0 and "every checksum matches" in ok.stdout, ok.stderr
    path, entry = data_file(save_dir, "table")
    data = bytearray(path.read_bytes())
    data[entry["data_offset"]] ^= 1
    path.write_bytes(bytes(data))
    bad = subprocess.run([*run, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 1 and str(path) in bad.stdout
    for argv in (["--help"], ["checkpoint", "--help"], ["checkpoint", "inspect", "--help"]):
        shown = subprocess.run(
            [sys.executable, "-m", "mpidist", *argv], capture_output=True, text=True, timeout=TIMEOUT
        )
        assert shown.returncode == 0 and "usage: python -m mpidist" in shown.stdout


# -- bfloat16 ---------------------------------------------------------------------------------------
ALL_BITS = np.arange(1 << 16, dtype=np.uint16)  # every bfloat16: zeros, subnormals, infinities, NaN payloads


@pytest.fixture
def bfloat16():
    return np.dtype(pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes").bfloat16)


def bfloat16_checkpoint(strategy, bfloat16):
    """Every bfloat16 bit pattern as a mirrored variable and as an array, sync-on-read SUM and MEAN variables,
    and a float32 array (unchanged by a save that holds bfloat16)."""
    with strategy.scope():
        weights = mpidist.Variable(ALL_BITS.view(bfloat16).copy(), name="weights")
        total = mpidist.Variable(
            np.array([1.5, -3.0, 2.0**-100], bfloat16), synchronization="on_read", aggregation="sum"
        )
        mean = mpidist.Variable(np.array([0.1, 7.0], bfloat16), synchronization="on_read", aggregation="mean")
    table = ALL_BITS[::-1].view(bfloat16).copy()
    return Checkpoint(weights=weights, total=total, mean=mean, table=table, scale=np.arange(3, dtype=np.float32))


def test_bfloat16_items_restore_bit_for_bit(strategy, bfloat16, tmp_path):
    checkpoint = bfloat16_checkpoint(strategy, bfloat16)
    saved = {
        name: np.array(value if isinstance(value, np.ndarray) else value.values[0])
        for name, value in checkpoint.items.items()
    }
    checkpoint.save(tmp_path / "ckpt", block_bytes=64)
    for item in checkpoint.items.values():
        (item if isinstance(item, np.ndarray) else item.values[0])[...] = 0
    with strategy.scope():
        checkpoint.restore(tmp_path / "ckpt")
    arrays = read_checkpoint(tmp_path / "ckpt")
    for name, value in saved.items():
        item = checkpoint.items[name]
        restored = item if isinstance(item, np.ndarray) else item.values[0]
        assert restored.dtype == arrays[name].dtype == value.dtype, name
        assert (restored.view(np.uint8) == value.view(np.uint8)).all(), name
        assert (arrays[name].view(np.uint8) == value.view(np.uint8)).all(), name
    assert (arrays["weights"].view(np.uint16) == ALL_BITS).all()


def test_bfloat16_is_stored_as_uint16_bits_that_numpy_alone_reads(strategy, bfloat16, tmp_path):
    save_dir = Path(bfloat16_checkpoint(strategy, bfloat16).save(tmp_path / "ckpt", block_bytes=64))
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    assert manifest["format_version"] == 2  # format 1 has no bfloat16: a reader of format 1 refuses it cleanly
    path, entry = data_file(save_dir, "weights")
    assert entry["dtype"] == "bfloat16" and entry["shape"] == [1 << 16] and entry["nbytes"] == 2 << 16
    bits = np.load(path, allow_pickle=False)
    assert bits.dtype == np.dtype("<u2") and (bits == ALL_BITS).all()
    data = path.read_bytes()
    assert zlib.crc32(data[: entry["data_offset"]]) == entry["header_crc32"]
    assert entry["chunk_crc32"] == [zlib.crc32(data[entry["data_offset"] :][i : i + 64]) for i in range(0, 2 << 16, 64)]
    # what the docs tell a reader without ml_dtypes: the bits are the upper half of a float32
    as_float32 = (bits.astype(np.uint32) << 16).view(np.float32)
    finite = np.isfinite(as_float32)
    assert (as_float32[finite] == ALL_BITS[finite].view(bfloat16).astype(np.float32)).all()
    assert (bits.view(bfloat16).view(np.uint16) == ALL_BITS).all()
    assert np.dtype(data_file(save_dir, "scale")[1]["dtype"]) == np.float32


def test_bfloat16_and_another_dtype_do_not_match_either_way(strategy, bfloat16, tmp_path):
    with strategy.scope():
        half = mpidist.Variable(np.arange(4).astype(bfloat16), name="w")
        single = mpidist.Variable(np.full(4, 9, np.float32), name="w")
        Checkpoint(w=half).save(tmp_path / "half")
        Checkpoint(w=single).save(tmp_path / "single")
        with pytest.raises(ValueError, match="'w' has dtype bfloat16 in the checkpoint but float32 here"):
            Checkpoint(w=single).restore(tmp_path / "half")
        with pytest.raises(ValueError, match="'w' has dtype float32 in the checkpoint but bfloat16 here"):
            Checkpoint(w=half).restore(tmp_path / "single")
        bits = np.full(4, 9, np.uint16)  # the dtype of the file, not of the values
        with pytest.raises(ValueError, match="'w' has dtype bfloat16 in the checkpoint but uint16 here"):
            Checkpoint(w=bits).restore(tmp_path / "half")
    assert (single.values[0] == 9).all() and (bits == 9).all() and (half.values[0] == np.arange(4)).all()


def test_without_ml_dtypes_bfloat16_is_listed_but_not_restored(strategy, bfloat16, tmp_path, monkeypatch, capsys):
    checkpoint = bfloat16_checkpoint(strategy, bfloat16)
    checkpoint.save(tmp_path / "ckpt", block_bytes=64)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes raises ImportError
    with pytest.raises(
        TypeError,
        match=r"entry 'mean' is bfloat16, which needs ml_dtypes \(pip install 'mpidist\[bfloat16\]'\); without it, "
        r"numpy.load reads its file 0000-mean.npy as the uint16 bits",
    ):
        read_checkpoint(tmp_path / "ckpt")
    table = np.zeros(1 << 16, np.float32)
    with (
        strategy.scope(),
        pytest.raises(
            ValueError,
            match=r"'table' has dtype bfloat16 in the checkpoint but float32 here \(bfloat16 needs ml_dtypes, which is "
            r"not installed: pip install 'mpidist\[bfloat16\]'\)",
        ),
    ):
        Checkpoint(table=table).restore(tmp_path / "ckpt")
    with strategy.scope():  # the other entries are restored as before
        scale = np.zeros(3, np.float32)
        Checkpoint(scale=scale).restore(tmp_path / "ckpt")
    assert (scale == np.arange(3)).all() and (table == 0).all()
    assert cli(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "format 2;" in out and "every checksum matches" in out
    assert [line.split()[:4] for line in out.splitlines() if line.startswith("  weights")] == [
        ["weights", "mirrored", "(65536,)", "bfloat16"]
    ]


def test_a_damaged_bfloat16_block_is_named(strategy, bfloat16, tmp_path, capsys):
    save_dir = Path(bfloat16_checkpoint(strategy, bfloat16).save(tmp_path / "ckpt", block_bytes=64))
    path, entry = data_file(save_dir, "table")
    data = bytearray(path.read_bytes())
    data[entry["data_offset"] + 200] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"'table', bytes 192-256 \(block 3\)"):
        read_checkpoint(save_dir)
    assert cli(["checkpoint", "inspect", "--no-verify", str(save_dir)]) == 0
    assert cli(["checkpoint", "inspect", str(save_dir)]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_a_manifest_must_not_claim_bfloat16_in_format_1_or_another_item_size(strategy, bfloat16, tmp_path):
    save_dir = Path(bfloat16_checkpoint(strategy, bfloat16).save(tmp_path / "ckpt", block_bytes=64))
    original = json.loads((save_dir / fmt.MANIFEST).read_text())
    for change, refusal in [
        (lambda m: m.update(format_version=1), "entry 'mean' is bfloat16, which format version 1 cannot hold"),
        (lambda m: m["entries"][0].update(nbytes=8), r"entry 'mean': nbytes 8 does not match shape \[2\] of bfloat16"),
        (lambda m: m["entries"][0].update(dtype="<V2"), r"'dtype' has an unusable value '<V2'"),
    ]:
        manifest = json.loads(json.dumps(original))
        change(manifest)
        (save_dir / fmt.MANIFEST).write_bytes(fmt.encode_manifest(manifest))
        with pytest.raises(CheckpointError, match=f"malformed manifest.*{refusal}"):
            read_checkpoint(save_dir)


def test_a_reader_of_format_1_refuses_a_bfloat16_save_asking_for_an_upgrade(strategy, bfloat16, tmp_path, monkeypatch):
    from mpidist._checkpoint import validate

    bfloat16_checkpoint(strategy, bfloat16).save(tmp_path / "ckpt")
    monkeypatch.setattr(validate, "FORMAT_VERSION", 1)  # what every mpidist before bfloat16 checkpoints reads
    with pytest.raises(
        CheckpointError, match=r"checkpoint format version 2 is newer than this mpidist .* reads \(1\); upgrade mpidist"
    ):
        read_checkpoint(tmp_path / "ckpt")
    make_checkpoint(strategy, tmp_path / "plain")  # no bfloat16: format 1, which it reads
    assert_expected(read_checkpoint(tmp_path / "plain"))


def test_ml_dtypes_other_types_are_refused_at_save(strategy, bfloat16, tmp_path):
    import ml_dtypes

    # float8_e5m2 is of kind 'f' with the dtype.str '<f1', which NumPy cannot read back
    for name in ("float8_e5m2", "float8_e4m3fn", "int4"):
        item = np.zeros(4, getattr(ml_dtypes, name))
        with (
            strategy.scope(),
            pytest.raises(TypeError, match=f"item 'x' has dtype {name}, which checkpoints cannot hold"),
        ):
            Checkpoint(x=item).save(tmp_path / "ckpt")
    assert not fmt.list_versions(tmp_path / "ckpt")


def test_bfloat16_is_refused_on_a_big_endian_machine(strategy, bfloat16, tmp_path, monkeypatch):
    checkpoint = bfloat16_checkpoint(strategy, bfloat16)
    checkpoint.save(tmp_path / "ckpt")
    monkeypatch.setattr(sys, "byteorder", "big")  # its bfloat16 bits in memory are not those of the file
    message = "is bfloat16, which checkpoints store as little-endian bits; this machine is big-endian"
    with strategy.scope(), pytest.raises(TypeError, match=f"item 'mean' {message}"):
        checkpoint.save(tmp_path / "ckpt")
    with pytest.raises(TypeError, match=f"entry 'mean' {message}"):
        read_checkpoint(tmp_path / "ckpt")


# -- iterator states with NaN and infinities --------------------------------------------------------
NONFINITE_STATE = {
    "loss": float("nan"),
    "best": float("inf"),
    "history": [1.5, float("-inf"), [None, float("nan")]],
    "none": None,
    "text": "NaN",
}


def refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def test_iterator_states_with_nan_and_infinities_are_strict_json_and_restore_exactly(strategy, tmp_path, capsys):
    with strategy.scope():
        checkpoint = Checkpoint(stats=Statistics(NONFINITE_STATE), bare=Statistics(float("nan")))
        save_dir = Path(checkpoint.save(tmp_path / "ckpt"))
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text(), parse_constant=refuse_constant)
    assert manifest["format_version"] == 3  # a reader of format 2 would take the nulls for the values: it refuses
    entries = {e["name"]: e for e in manifest["entries"]}
    assert entries["stats"]["state"]["loss"] is None and entries["stats"]["state"]["history"][2] == [None, None]
    assert entries["bare"]["state"] is None
    restored = Statistics(None), Statistics(None)
    with strategy.scope():
        Checkpoint(stats=restored[0], bare=restored[1]).restore(save_dir)
    state = restored[0].state
    assert np.isnan(state["loss"]) and state["best"] == float("inf") and state["none"] is None
    assert state["history"][:2] == [1.5, float("-inf")] and state["history"][2][0] is None
    assert np.isnan(state["history"][2][1]) and state["text"] == "NaN" and np.isnan(restored[1].state)
    assert cli(["checkpoint", "inspect", str(save_dir)]) == 0
    assert '"loss": NaN' in capsys.readouterr().out  # listed as Python writes the value
    assert cli(["checkpoint", "inspect", "--json", str(save_dir)]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=refuse_constant)  # the manifest as saved
    assert report["manifest"] == manifest


def test_a_reader_of_format_2_refuses_a_save_with_nonfinite_states(strategy, tmp_path, monkeypatch):
    from mpidist._checkpoint import validate

    with strategy.scope():
        Checkpoint(stats=Statistics(NONFINITE_STATE)).save(tmp_path / "ckpt")
    monkeypatch.setattr(validate, "FORMAT_VERSION", 2)
    with pytest.raises(CheckpointError, match=r"checkpoint format version 3 is newer than this mpidist .* reads \(2\)"):
        read_checkpoint(tmp_path / "ckpt")


def test_a_state_saved_with_nan_by_an_earlier_version_still_restores(strategy, tmp_path):
    with strategy.scope():
        save_dir = Path(Checkpoint(stats=Statistics({"loss": 0.0})).save(tmp_path / "ckpt"))
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    manifest["entries"][0]["state"]["loss"] = float("nan")  # written as NaN, as versions before format 3 did
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    (save_dir / fmt.MANIFEST).write_text(json.dumps({**body, "manifest_crc32": zlib.crc32(fmt.canonical(body))}))
    restored = Statistics(None)
    with strategy.scope():
        Checkpoint(stats=restored).restore(save_dir)
    assert np.isnan(restored.state["loss"])


@pytest.mark.parametrize(
    "marks, refusal",
    [
        ([[["state", "loss"], "NaN"]], "format version 2 cannot hold"),
        ([[["state", "loss"], "nan"]], r"unusable non-finite mark \[\['state', 'loss'\], 'nan'\]"),
        ([[["state", "text"], "NaN"]], r"non-finite mark \['state', 'text'\] is not at a null"),
        ([[["state", "gone"], "NaN"]], r"non-finite mark \['state', 'gone'\] leads nowhere"),
        ([[["state", "history", 5], "NaN"]], r"non-finite mark \['state', 'history', 5\] leads nowhere"),
        ([[["state", "history", True], "NaN"]], r"non-finite mark \['state', 'history', True\] leads nowhere"),
        ([[["name"], "NaN"]], r"non-finite mark \['name'\] is not inside the state"),
        ([[[], "NaN"]], r"unusable non-finite mark"),
        ([], r"'nonfinite' has an unusable value \[\]"),
        ("NaN", r"'nonfinite' has an unusable value 'NaN'"),
    ],
)
def test_a_manifest_with_a_malformed_nonfinite_mark_is_refused(strategy, tmp_path, marks, refusal):
    with strategy.scope():
        save_dir = Path(Checkpoint(stats=Statistics(NONFINITE_STATE)).save(tmp_path / "ckpt"))
    manifest = json.loads((save_dir / fmt.MANIFEST).read_text())
    manifest["entries"][0][fmt.NONFINITE] = marks
    if "format version 2" in refusal:
        manifest["format_version"] = 2
    (save_dir / fmt.MANIFEST).write_bytes(fmt.encode_manifest(manifest))
    with pytest.raises(CheckpointError, match=f"malformed manifest.*{refusal}"):
        read_checkpoint(save_dir)


# -- saves killed with SIGKILL ----------------------------------------------------------------------
def assert_complete_save(path, k=None):
    """The save at ``path`` verifies and all its entries belong to one save k; returns k."""
    arrays = read_checkpoint(path)
    with Save.open(path) as save:
        manifest = save.manifest
    position = next(e for e in manifest["entries"] if e["name"] == "position")["state"]["position"]
    if k is not None:
        assert position == k
    assert (arrays["weights"] == position).all()
    assert int(arrays["counter"]) == 10 * position
    assert inspect(path).ok
    return position


@pytest.mark.parametrize("mode", ["kill-during-write", "kill-before-commit"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, mode):
    path = tmp_path / "ckpt"
    result = run_mpi(2, [sys.executable, str(JOB), str(path), mode], timeout=TIMEOUT)
    assert result.returncode not in (0, 3, None), result.describe()
    assert [v.name for v in fmt.list_versions(path)] == ["ckpt-000001"], result.describe()
    leftovers = [p.name for p in path.iterdir() if p.name.startswith(fmt.TMP_PREFIX)]
    assert len(leftovers) == 1, leftovers  # the killed save's temporary directory
    if mode == "kill-before-commit":
        assert (path / leftovers[0] / fmt.MANIFEST).is_file()  # complete, but never renamed
    assert_complete_save(path, k=1)


@pytest.mark.parametrize("delay", [0.0, 0.13])
def test_saves_killed_from_outside_at_any_moment_leave_a_verified_checkpoint(tmp_path, delay):
    path = tmp_path / "ckpt"
    pids = Path(str(path) + ".pids")
    outcome = {}
    job = threading.Thread(
        target=lambda: outcome.update(result=run_mpi(2, [sys.executable, str(JOB), str(path), "loop"], timeout=TIMEOUT))
    )
    job.start()
    deadline = time.monotonic() + TIMEOUT / 2
    # wait until save 2 or later is being written, then kill both ranks at once
    while time.monotonic() < deadline and job.is_alive():
        if len(list(pids.glob("rank*"))) == 2 and any(p.name.startswith(fmt.TMP_PREFIX) for p in path.iterdir()):
            break
        time.sleep(0.002)
    time.sleep(delay)
    for pid_file in pids.glob("rank*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.join(TIMEOUT)
    result = outcome["result"]
    assert result.returncode not in (0, 3, None), result.describe()
    # keep=2, plus one more when the kill came between the commit and the removal of the oldest
    assert 1 <= len(fmt.list_versions(path)) <= 3, result.describe()
    assert assert_complete_save(path) >= 1
