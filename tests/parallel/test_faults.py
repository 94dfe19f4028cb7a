"""Errors instead of hangs (api-contract C8), checked on whole jobs under a real ``mpiexec``.

Each test launches ``tests/helpers/samples/fault_job.py`` as its own MPI job, under a
timeout, with a plain ``mpiexec -n N python script.py`` (no ``-m mpi4py``), so
what is checked is mpidist's own behaviour.
"""

import os
import re
import sys
from pathlib import Path

import pytest

from mpirun import run_command, run_mpi
from paths import SAMPLES

JOB = str(SAMPLES / "fault_job.py")


def launch(n, scenario, out_dir, **env):
    """Run the job at ``n`` ranks; returns (result, {rank: outcome})."""
    env = {**os.environ, "FAULT_OUT": str(out_dir), **env}
    result = run_mpi(n, [sys.executable, JOB, scenario], timeout=60, env=env)
    seen = {int(p.stem[4:]): p.read_text() for p in Path(out_dir).glob("rank*.txt")}
    return result, seen


@pytest.mark.parametrize("n", [2, 3])
def test_shape_mismatch_raises_on_every_rank(n, tmp_path):
    result, seen = launch(n, "shape_mismatch", tmp_path)
    assert result.returncode == 0, result.describe()
    assert sorted(seen) == list(range(n)), result.describe()
    for rank, line in seen.items():
        assert line.startswith("CollectiveMismatchError"), result.describe()
        assert "float64[2]" in line and "float64[3]" in line and f"rank {rank}:" in line


def test_rank_skipping_a_collective_is_named_within_the_timeout(tmp_path):
    timeout = 3.0
    result, seen = launch(3, "skip_collective", tmp_path, FAULT_TIMEOUT=str(timeout))
    assert seen.get(1) == "skipped the collective", result.describe()
    for rank in (0, 2):
        pattern = r"CollectiveTimeoutError after ([\d.]+) s missing=\[1\]: .*rank 1 has not answered"
        match = re.match(pattern, seen.get(rank, ""))
        assert match, result.describe()
        assert timeout <= float(match.group(1)) <= 1.6 * timeout, result.describe()  # a doubled deadline fails


def test_uncaught_exception_on_one_rank_ends_the_job(tmp_path):
    result, seen = launch(3, "raise_on_rank1", tmp_path)
    assert result.returncode not in (0, None), result.describe()
    assert result.elapsed < 10, result.describe()
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in result.stderr, result.describe()
    assert "uncaught RuntimeError on rank 1 of 3" in result.stderr, result.describe()
    assert seen == {}, seen  # nobody got past the barrier


def test_killed_rank_ends_the_job(tmp_path):
    result, seen = launch(3, "sigkill_rank1", tmp_path)
    assert result.returncode not in (0, None), result.describe()
    assert result.elapsed < 30, result.describe()
    assert seen == {}, seen


def test_one_rank_world_keeps_pythons_own_exit(tmp_path):
    """A plain `python script.py` (one rank) has nobody to wake: the usual traceback and exit status 1."""
    env = {**os.environ, "FAULT_OUT": str(tmp_path)}
    result = run_command([sys.executable, JOB, "raise_everywhere"], timeout=60, env=env)
    assert result.returncode == 1, result.describe()
    assert "RuntimeError: deliberate failure on rank 0" in result.stderr, result.describe()
    assert "aborting" not in result.stderr and "[rank 0]" not in result.stderr, result.describe()
