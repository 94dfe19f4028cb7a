"""The life cycle of whole jobs: nothing around the collectives crashes or hangs, at exit above all.

Each test launches ``tests/helpers/samples/lifecycle_job.py`` under a real ``mpiexec`` and checks
the job's exit status and duration and what each rank reported: a handle never waited, or
dropped by one rank only, completes (also with every check off, where the handle alone holds its
temporary input); a strategy no longer referenced, strategies left behind by caught checkpoint
errors and a save on one rank only never stall the exit (a stall would last the 20 s deadline); a
rank that arrives after the others' deadline raises at once, and a job in which a deadline passed
ends with exit status 1.
"""

import os
import sys
from pathlib import Path

import pytest

from mpidist._errors import format_ranks
from mpirun import MPIResult, run_mpi
from paths import SAMPLES

JOB = str(SAMPLES / "lifecycle_job.py")
DEADLINE = 20.0  # the job's deadline where none may pass: a stall at exit would last this long


def launch(
    n: int, scenario: str, out_dir: Path, *args: str
) -> tuple[MPIResult, dict[int, dict[str, tuple[float, str]]]]:
    """Run the scenario at ``n`` ranks; the result and every rank's {case: (seconds, outcome)}."""
    result = run_mpi(n, [sys.executable, JOB, scenario, str(out_dir), *args], timeout=60, env=dict(os.environ))
    seen: dict[int, dict[str, tuple[float, str]]] = {}
    for r in range(n):
        path = out_dir / f"rank{r}.txt"
        rows = [line.split(" ", 2) for line in path.read_text().splitlines()] if path.exists() else []
        seen[r] = {case: (float(seconds), outcome) for case, seconds, outcome in rows}
    return result, seen


def triangle(n: int) -> float:
    return n * (n + 1) / 2


@pytest.mark.parametrize("setting", ["default", "checks-off"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_handle_never_waited_completes_at_exit(n, setting, tmp_path):
    result, seen = launch(n, "never_waited", tmp_path, setting)
    assert result.returncode == 0, result.describe()
    for r in range(n):
        assert seen[r]["never_waited"][1] == f"ok {triangle(n)} {triangle(n)}", result.describe()


@pytest.mark.parametrize("setting", ["default", "checks-off"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_handle_dropped_on_one_rank_changes_nothing(n, setting, tmp_path):
    result, seen = launch(n, "dropped", tmp_path, setting)
    assert result.returncode == 0, result.describe()
    for r in range(n):
        assert seen[r]["next"][1] == f"ok {[float(n)] * 3}", result.describe()
        if r:
            assert seen[r]["waited"][1] == f"ok { {triangle(n)} }", result.describe()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_strategy_created_in_a_function_never_stalls_the_exit(n, tmp_path):
    """train() creates the strategy and returns; rank 0 then writes a report while the others exit."""
    result, seen = launch(n, "strategy_in_function", tmp_path)
    assert result.returncode == 0, result.describe()
    assert result.elapsed < DEADLINE, result.describe()
    assert seen[0]["report"][1] == "ok [3.0, 3.0, 3.0]", result.describe()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_caught_checkpoint_errors_never_stall_the_exit(n, tmp_path):
    """Three strategies left behind by caught restore errors, then a save on rank 0 only while the others exit."""
    result, seen = launch(n, "checkpoint_errors", tmp_path)
    assert result.returncode == 0, result.describe()
    assert result.elapsed < DEADLINE, result.describe()
    for r in range(n):
        for kind in ("shape", "dtype", "name"):
            assert seen[r][f"restore_{kind}"][1].startswith(f"ValueError: rank {r}: "), result.describe()
    seconds, outcome = seen[0]["save_alone"]
    if n == 1:
        assert outcome.startswith("ok ") and outcome.endswith("ckpt-000001"), result.describe()
    else:  # the others' departure reaches rank 0 in whichever communicator it waits
        assert outcome.startswith(f"RankLeftError: rank 0: rank{'s' if n > 2 else ''} {format_ranks(range(1, n))} left")
        assert seconds < 5, result.describe()


@pytest.mark.parametrize("n", [2, 3])
def test_a_late_rank_learns_that_its_call_was_abandoned(n, tmp_path):
    """timeout=2: the last rank is 4 s late. The others raise at their deadline; the late rank raises at
    once, in its late call or (where MPI completed that call with the data the others had sent) in the
    next one; the ranks that saw the error exit with status 1."""
    result, seen = launch(n, "late", tmp_path)
    # status 1, or the launcher's for ranks it ended because another rank exited with 1 (MPICH: 9)
    assert result.returncode not in (0, None), result.describe()
    assert "ends with exit status 1" in result.stderr and result.elapsed < DEADLINE, result.describe()
    late = n - 1
    for r in range(late):
        seconds, outcome = seen[r]["reduce"]
        assert outcome.startswith(f"CollectiveTimeoutError: rank {r}: "), result.describe()
        assert f"rank {late} has not answered" in outcome and 2.0 <= seconds < 2.0 + 2, result.describe()
        assert (tmp_path / f"unclosed{r}.txt").read_text() == "written after the deadline error"
    seconds, outcome = seen[late]["reduce"]
    if outcome == f"ok {[float(n)] * 2}":  # every rank's data had arrived: the sum is right
        seconds, outcome = seen[late]["next"]
    # the ranks whose notice had arrived: one of them at least
    named = {f"rank {r}" for r in range(late)} | {f"ranks {format_ranks(range(late))}"}
    gave_up = [f"CollectiveTimeoutError: rank {late}: {who} gave up on collective #" for who in named]
    assert any(outcome.startswith(text) for text in gave_up), result.describe()
    assert seconds < 1.0, result.describe()
