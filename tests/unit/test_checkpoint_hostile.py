"""Hostile checkpoints: crafted manifests, links, FIFOs and directories where data files should be.

Each crafted save is read in a subprocess (tests/helpers/samples/checkpoint_read_job.py) whose address
space may grow by at most 1 GiB and which must finish within a deadline: the reader must raise a
clean ``CheckpointError`` (or ``FileNotFoundError``), and ``checkpoint inspect`` must exit with 1
(damaged) or 3 (malformed or unreadable) on one line, never with a traceback, a hang or a
``MemoryError``. Random mutations of a real manifest (with its CRC-32 recomputed, so that the
checks behind the checksum are reached) come from a fixed seed, so a failure repeats.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import mpidist
from mpidist._checkpoint import format as fmt
from mpidist._checkpoint.checkpoint import Checkpoint
from paths import SAMPLES

JOB = SAMPLES / "checkpoint_read_job.py"
MEMORY_LIMIT = 1 << 30
DEADLINE = 120


class Position:
    def __init__(self) -> None:
        self.position = 5

    def get_state(self) -> dict:
        return {"position": self.position, "order": [3, 1, 2]}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One real save (a mirrored and a sync-on-read variable, an array, an iterator state)."""
    from mpi4py import MPI

    strategy = mpidist.MPIStrategy(comm=MPI.COMM_SELF, device="cpu")
    try:
        with strategy.scope():
            weights = mpidist.Variable(np.arange(24, dtype=np.float32).reshape(4, 6), name="weights")
            total = mpidist.Variable(np.arange(3.0), synchronization="on_read", aggregation="sum")
        root = tmp_path_factory.mktemp("base") / "ckpt"
        Checkpoint(weights=weights, total=total, table=np.arange(5, dtype=np.int16), position=Position()).save(
            root, block_bytes=32
        )
    finally:
        strategy.free()
    return root


def copy_of(base: Path, target: Path) -> Path:
    shutil.copytree(base, target, symlinks=True)
    return target


def save_dir(root: Path) -> Path:
    return root / "ckpt-000001"


def manifest_of(root: Path) -> dict:
    return json.loads((save_dir(root) / fmt.MANIFEST).read_text())


def rewrite(root: Path, change: Callable[[dict], Any]) -> None:
    """Apply ``change`` to the manifest and write it back with a correct CRC-32, as any writer could: NaN and
    infinities as JSON's non-strict tokens (which mpidist itself no longer writes, and earlier versions did)."""
    manifest = manifest_of(root)
    change(manifest)
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    text = json.dumps({**body, "manifest_crc32": zlib.crc32(fmt.canonical(body))}, indent=1)
    (save_dir(root) / fmt.MANIFEST).write_text(text)


def entry(manifest: dict, name: str) -> dict:
    return next(e for e in manifest["entries"] if e["name"] == name)


def data_path(root: Path, name: str) -> Path:
    return save_dir(root) / entry(manifest_of(root), name)["file"]


def read_in_subprocess(paths: list[Path]) -> list[dict]:
    result = subprocess.run(
        [sys.executable, str(JOB), str(MEMORY_LIMIT), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["path"] for line in lines] == list(map(str, paths))
    return lines


def assert_refused(line: dict, inspect_status: set[int] = frozenset({1, 3})) -> None:
    assert line["read"] in ("CheckpointError", "ChecksumError", "FileNotFoundError"), line
    assert line["read_no_verify"] in ("CheckpointError", "ChecksumError", "FileNotFoundError"), line
    for key in ("inspect", "inspect_no_verify"):
        assert line[key]["status"] in inspect_status, line
        output = line[key]["output"]
        assert "Traceback" not in output and "MemoryError" not in output and "RecursionError" not in output, line
        assert all(c.isprintable() or c == "\n" for c in output), line


# -- files that are not regular files ------------------------------------------------------
def fifo_data_file(root: Path) -> None:
    path = data_path(root, "weights")
    path.unlink()
    os.mkfifo(path)


def directory_data_file(root: Path) -> None:
    path = data_path(root, "table")
    path.unlink()
    path.mkdir()


def data_file_linked_outside(root: Path) -> None:
    path = data_path(root, "weights")
    outside = root.parent / f"{root.name}-outside.npy"
    shutil.copy(path, outside)  # a valid file with the right bytes: only the link is wrong
    path.unlink()
    path.symlink_to(outside)


def manifest_linked_outside(root: Path) -> None:
    manifest = save_dir(root) / fmt.MANIFEST
    outside = root.parent / f"{root.name}-manifest.json"
    shutil.copy(manifest, outside)
    manifest.unlink()
    manifest.symlink_to(outside)


def manifest_is_a_fifo(root: Path) -> None:
    manifest = save_dir(root) / fmt.MANIFEST
    manifest.unlink()
    os.mkfifo(manifest)


def save_linked_outside(root: Path) -> None:
    outside = root.parent / f"{root.name}-save"
    save_dir(root).rename(outside)
    save_dir(root).symlink_to(outside)


# -- manifests that ask for too much ---------------------------------------------------------
def huge_data_offset(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "table").update(data_offset=2**32 - 1))


def five_huge_data_offsets(root: Path) -> None:
    def change(m: dict) -> None:
        template = entry(m, "table")
        m["entries"] += [
            {**template, "name": f"big{i}", "file": f"{90 + i:04d}-big.npy", "data_offset": 2**32 - 1} for i in range(5)
        ]

    rewrite(root, change)


def dimension_of_two_to_the_64(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "table").update(shape=[2**64], nbytes=2**65))


def product_overflows_int64(root: Path) -> None:  # 2^32 * 2^32 * 2 wraps to 0 in int64
    rewrite(root, lambda m: entry(m, "table").update(shape=[2**32, 2**32, 2], nbytes=0, chunk_crc32=[]))


def wrapped_negative_size(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "table").update(nbytes=2**64 - 10))


def negative_size(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "table").update(nbytes=-10, shape=[-5]))


def one_tebibyte_declared(root: Path) -> None:
    rewrite(
        root,
        lambda m: (
            m.update(chunk_bytes=2**40),  # the on-disk key names of format 1
            entry(m, "table").update(shape=[2**39], nbytes=2**40, chunk_crc32=[0]),
            entry(m, "weights").update(chunk_crc32=[0]),
            entry(m, "total").update(chunk_crc32=[0]),
        ),
    )


def non_string_aggregation(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "total").update(aggregation=["sum"]))


def unknown_aggregation(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "weights").update(aggregation="median"))


def object_dtype(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "table").update(dtype="|O8"))


def structured_dtype(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "table").update(dtype=[["a", "<i2"]]))


def bfloat16_in_format_1(root: Path) -> None:  # the sizes fit (two bytes an item): only the version refuses it
    rewrite(root, lambda m: entry(m, "table").update(dtype="bfloat16"))


def nested_a_hundred_deep(root: Path) -> None:
    state: Any = 1
    for _ in range(100):
        state = [state]
    rewrite(root, lambda m: entry(m, "position").update(state=state))


def nested_beyond_the_json_parser(root: Path) -> None:  # cannot carry a CRC: the text alone is hostile
    text = (save_dir(root) / fmt.MANIFEST).read_text()
    (save_dir(root) / fmt.MANIFEST).write_text(
        text.replace('"order": [', '"order": ' + "[" * 200_000 + "]" * 200_000 + ', "x": [', 1)
    )


def manifest_too_large(root: Path) -> None:
    with open(save_dir(root) / fmt.MANIFEST, "r+b") as manifest:
        manifest.truncate(65 << 20)


def two_entries_one_file(root: Path) -> None:
    rewrite(root, lambda m: entry(m, "weights").update(file=entry(m, "total")["file"]))


def entries_not_a_list(root: Path) -> None:
    rewrite(root, lambda m: m.update(entries={"a": 1}))


def manifest_is_a_list(root: Path) -> None:
    (save_dir(root) / fmt.MANIFEST).write_text("[1, 2, 3]")


CASES = [
    fifo_data_file,
    directory_data_file,
    data_file_linked_outside,
    manifest_linked_outside,
    manifest_is_a_fifo,
    save_linked_outside,
    huge_data_offset,
    five_huge_data_offsets,
    dimension_of_two_to_the_64,
    product_overflows_int64,
    wrapped_negative_size,
    negative_size,
    one_tebibyte_declared,
    non_string_aggregation,
    unknown_aggregation,
    object_dtype,
    structured_dtype,
    bfloat16_in_format_1,
    nested_a_hundred_deep,
    nested_beyond_the_json_parser,
    manifest_too_large,
    two_entries_one_file,
    entries_not_a_list,
    manifest_is_a_list,
]


def test_every_crafted_save_is_refused_cleanly(base, tmp_path):
    roots = []
    for case in CASES:
        root = copy_of(base, tmp_path / case.__name__)
        case(root)
        roots.append(root)
    lines = read_in_subprocess(roots)
    for line in lines:  # each line names its save (a folder named after the case)
        assert_refused(line)
    by_case = dict(zip((c.__name__ for c in CASES), lines))
    # damage (sizes) is 1, everything a reader refuses to use is 3
    assert by_case["one_tebibyte_declared"]["inspect"]["status"] == 1
    for name in (
        "fifo_data_file",
        "directory_data_file",
        "data_file_linked_outside",
        "manifest_linked_outside",
        "manifest_is_a_fifo",
        "save_linked_outside",
        "huge_data_offset",
        "dimension_of_two_to_the_64",
        "non_string_aggregation",
        "bfloat16_in_format_1",
        "nested_beyond_the_json_parser",
        "manifest_too_large",
    ):
        assert by_case[name]["inspect"]["status"] == 3, by_case[name]
        assert by_case[name]["read"] == "CheckpointError", by_case[name]
    fifo = by_case["fifo_data_file"]["inspect"]["output"]
    assert "is a FIFO, not a regular file" in fifo and "weights.npy" in fifo
    assert "is a symbolic link" in by_case["data_file_linked_outside"]["inspect"]["output"]
    assert "is a symbolic link" in by_case["save_linked_outside"]["inspect"]["output"]
    assert "is a directory" in by_case["directory_data_file"]["inspect"]["output"]


def test_control_characters_in_names_are_escaped_when_printed(base, tmp_path):
    root = copy_of(base, tmp_path / "ckpt")
    rewrite(root, lambda m: entry(m, "table").update(name="tab\x1b[31mle\r"))
    (fine,) = read_in_subprocess([root])
    assert fine["read"] is None and fine["inspect"]["status"] == 0, fine
    assert "tab\\x1b[31mle\\r" in fine["inspect"]["output"] and "\x1b" not in fine["inspect"]["output"]
    path = data_path(root, "tab\x1b[31mle\r")
    path.write_bytes(path.read_bytes()[:-1])
    (damaged,) = read_in_subprocess([root])
    assert damaged["read"] == "ChecksumError" and damaged["inspect"]["status"] == 1, damaged
    assert "'tab\\x1b[31mle\\r'" in damaged["inspect"]["output"] and "\x1b" not in damaged["inspect"]["output"]


def test_the_path_given_may_be_a_symbolic_link(base, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(base)
    (line,) = read_in_subprocess([link])
    assert line["read"] is None and line["inspect"]["status"] == 0, line


# -- random mutations ------------------------------------------------------------------------
HOSTILE_VALUES = [
    None,
    True,
    -1,
    0,
    1,
    2**31,
    2**32 - 1,
    2**63,
    2**64 + 1,
    -(2**63),
    1.5,
    float("inf"),
    "",
    "x",
    "<f8",
    "|O",
    "<V8",
    "../../etc/passwd",
    "a" * 5000,
    [],
    [0] * 3,
    [-1],
    {},
    {"a": [1]},
]


def paths_in(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys and indices) to a value inside a JSON value."""
    found = [prefix] if prefix else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found += paths_in(child, prefix + (key,))
    return found


def mutate(manifest: dict, rng: random.Random) -> None:
    """Replace, delete or duplicate one value somewhere in the manifest."""
    path = rng.choice(paths_in(manifest))
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    action = rng.random()
    if action < 0.7:
        parent[path[-1]] = rng.choice(HOSTILE_VALUES)
    elif action < 0.85:
        del parent[path[-1]]
    elif isinstance(parent, list):
        parent.append(parent[path[-1]])
    else:
        parent[path[-1]] = [parent[path[-1]]] * 2


def test_random_manifest_mutations_are_refused_or_read_correctly(base, tmp_path):
    rng = random.Random(20261201)
    roots = []
    for k in range(60):
        root = copy_of(base, tmp_path / f"mutant{k}")
        rewrite(root, lambda m: [mutate(m, rng) for _ in range(rng.randint(1, 3))])
        roots.append(root)
    for line in read_in_subprocess(roots):
        # a mutation of a field nobody reads (e.g. "created") may leave a readable save
        if line["read"] is None:
            assert line["inspect"]["status"] == 0, line
        else:
            assert_refused(line)
