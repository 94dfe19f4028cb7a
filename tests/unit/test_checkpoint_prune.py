"""Removal of old saves killed with SIGKILL at every step: no half-deleted save is ever listed.

Each run of tests/helpers/samples/checkpoint_prune_job.py keeps saves 1-3, then makes save 4 with
keep=1 and kills itself at the N-th rename, unlink or rmdir of the removal of saves 1-3 and
of a leftover. Whatever N, every listed save must be complete and hold its own values, and
the next save removes every leftover.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpidist
from mpidist._checkpoint import format as fmt
from mpidist._checkpoint.checkpoint import Checkpoint, read_checkpoint
from mpidist._checkpoint.reader import Save, inspect
from paths import SAMPLES

JOB = SAMPLES / "checkpoint_prune_job.py"
TIMEOUT = 60


def assert_listing_consistent(path: Path) -> list[int]:
    """Every listed save verifies and its entries all belong to one save k; returns the ks."""
    found = []
    for version in fmt.list_versions(path):
        arrays = read_checkpoint(version)
        with Save.open(version) as save:
            k = next(e for e in save.manifest["entries"] if e["name"] == "position")["state"]["position"]
        assert version.name == f"ckpt-{k:06d}"
        assert (arrays["weights"] == k).all() and inspect(version).ok
        found.append(k)
    return found


def test_a_removal_killed_at_any_step_lists_only_complete_saves(tmp_path):
    from mpi4py import MPI

    outcomes = []
    for kill_at in range(40):
        path = tmp_path / f"kill{kill_at}"
        result = subprocess.run(
            [sys.executable, str(JOB), str(path), str(kill_at)], capture_output=True, text=True, timeout=TIMEOUT
        )
        assert result.returncode in (-9, 3), result.stderr
        found = assert_listing_consistent(path)
        assert found[-1] == 4 and set(found) <= {1, 2, 3, 4}, found
        outcomes.append((result.returncode, len(found)))
        if result.returncode == 3:
            break
    assert outcomes[-1] == (3, 1), outcomes  # the last run removed everything: the kill points covered all steps
    assert any(n == 4 for _, n in outcomes) and any(1 < n < 4 for _, n in outcomes) and len(outcomes) > 5, outcomes
    assert any(p.name.startswith((fmt.OLD_PREFIX, fmt.TMP_PREFIX)) for p in (tmp_path / "kill5").iterdir())
    # the next save removes the leftovers of every killed removal
    strategy = mpidist.MPIStrategy(comm=MPI.COMM_SELF, device="cpu")
    try:
        with strategy.scope():
            weights = mpidist.Variable(np.full(64, 5, np.float32), name="weights")
        path = tmp_path / "kill5"
        Checkpoint(weights=weights).save(path, keep=1, block_bytes=64)
    finally:
        strategy.free()
    assert sorted(p.name for p in path.iterdir()) == ["ckpt-000005"]


def test_prune_renames_each_old_save_before_deleting_it(tmp_path):
    path = tmp_path / "ckpt"
    for k in (1, 2, 3):
        (path / f"ckpt-{k:06d}").mkdir(parents=True)
        (path / f"ckpt-{k:06d}" / fmt.MANIFEST).write_text("{}")
    (path / f"{fmt.OLD_PREFIX}000000-00000000").mkdir()
    assert fmt.prune(path, 1, path / "ckpt-000003") == []
    assert sorted(p.name for p in path.iterdir()) == ["ckpt-000003"]


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_prune_removes_a_link_not_what_it_points_to(tmp_path, kind):
    path, outside = tmp_path / "ckpt", tmp_path / "outside"
    (path / "ckpt-000002").mkdir(parents=True)
    (path / "ckpt-000002" / fmt.MANIFEST).write_text("{}")
    outside.mkdir()
    (outside / fmt.MANIFEST).write_text("keep me")
    if kind == "symlink":
        (path / "ckpt-000001").symlink_to(outside)
    else:
        (path / f"{fmt.OLD_PREFIX}000001-00000000").write_text("leftover")
    assert fmt.prune(path, 1, path / "ckpt-000002") == []
    assert sorted(p.name for p in path.iterdir()) == ["ckpt-000002"]
    assert (outside / fmt.MANIFEST).read_text() == "keep me"
