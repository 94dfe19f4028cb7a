"""The straggler report on whole jobs (2 and 3 ranks): a rank sleeping 30% longer per step is named, and no
rank is named in 10,000 tiny steps without a straggler.

Each test launches ``tests/helpers/samples/straggler_job.py`` under a real ``mpiexec``; rank 0
writes every straggler line it logs, with the step it was logged in. The report's arithmetic is
tested serially in ``tests/unit/test_straggler.py``.
"""

import os
import re
import sys
from pathlib import Path

import pytest

from mpirun import run_mpi
from paths import SAMPLES

JOB = str(SAMPLES / "straggler_job.py")


def launch(n: int, scenario: str, out_dir: Path) -> list[tuple[int, str]]:
    """Run the scenario at ``n`` ranks; rank 0's straggler lines, as (step, message)."""
    result = run_mpi(n, [sys.executable, JOB, scenario, str(out_dir)], timeout=120, env=dict(os.environ))
    assert result.returncode == 0, result.describe()
    for r in range(n):
        assert (out_dir / f"rank{r}.txt").exists(), f"rank {r} did not finish\n{result.describe()}"
    lines = out_dir / "lines.txt"
    rows = [line.split(" ", 1) for line in lines.read_text().splitlines()] if lines.exists() else []
    return [(int(step), message) for step, message in rows]


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_sleeping_30_percent_longer_is_named_within_200_steps(n, tmp_path):
    lines = launch(n, "slow", tmp_path)
    slow = n - 1
    assert lines, "no straggler line in 200 steps"
    step, message = lines[0]
    assert step <= 200 and message.startswith(f"mpidist: rank {slow} of {n} is slow: "), lines
    assert "at least 20% above the mean of the other ranks" in message, message
    # the ranks' mean time between collectives: their sleeps (20 ms; 26 ms on the slow rank) and a little more
    mean = re.search(r"the ranks spent ([\d.]+) ms outside waiting on average, spread [\d.]+ (ms|us)", message)
    assert mean and 20.0 <= float(mean.group(1)) < 30.0, message
    assert len(lines) == 1, lines  # at most one line a minute


@pytest.mark.parametrize("n", [2, 3])
def test_no_rank_is_named_in_10000_tiny_steps_without_a_straggler(n, tmp_path):
    assert launch(n, "even", tmp_path) == []
