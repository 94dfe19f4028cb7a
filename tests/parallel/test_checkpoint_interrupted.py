"""Checkpoints after a save or restore that failed, or was left midway, on one rank (whole jobs at 1, 2, 3 ranks).

Each job runs ``tests/helpers/samples/checkpoint_interrupt_job.py``, where one rank fails inside
a step of a save or restore (a file-system error, a ``KeyboardInterrupt``, an exception from a
variable's value) or leaves a step in the middle of its collective; every rank catches what its
call raised and calls again. What must hold, on every rank: each failed call raised a clear
error within seconds (no rank waits for the 10 s deadline), the next call (or the one after a
``CollectiveMismatchError`` naming both steps) succeeds, the save that was there before stays
readable and unchanged, a failed restore modified nothing, and the job exits 0.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from mpirun import run_mpi
from paths import SAMPLES

JOB = SAMPLES / "checkpoint_interrupt_job.py"
SLOW = 5.0  # seconds: every call ends well before the job's 10 s deadline

# scenario: (the operation; the failing rank: 0 or the last; its failure; whether it raises that failure itself
#            (else the CheckpointError every rank raises); where a rank that left midway is and the others are:
#            (the collective the others are in, the one the failing rank's next call starts with))
INTERRUPT = "KeyboardInterrupt: injected"
SAVE_AGAIN = "Checkpoint.save 1/4: items and arguments (outcome)"
SCENARIOS = {
    "oserror-write": ("save", "last", "OSError: [Errno 5] injected", False, None),
    "interrupt-write": ("save", "last", INTERRUPT, True, None),
    "interrupt-commit": ("save", 0, INTERRUPT, True, None),
    "leave-write": ("save", "last", INTERRUPT, True, ("Checkpoint.save 3/4: write (outcome)", SAVE_AGAIN)),
    "leave-value": ("save", "last", "RuntimeError: injected", True, ("counter", SAVE_AGAIN)),
    "interrupt-read": ("restore", "last", INTERRUPT, True, None),
    "leave-read": (
        "restore",
        "last",
        INTERRUPT,
        True,
        ("Checkpoint.restore 3/4: read (outcome)", "Checkpoint.restore 1/4: manifest (outcome)"),
    ),
}


@pytest.fixture(scope="module", params=[1, 2, 3])
def job(request, tmp_path_factory) -> tuple[int, dict[int, dict]]:
    """Run the job once at each size; the size and every rank's report."""
    n = request.param
    base = tmp_path_factory.mktemp(f"interrupted-{n}")
    (base / "ckpt").mkdir()
    (base / "out").mkdir()
    result = run_mpi(n, [sys.executable, str(JOB), str(base / "ckpt"), str(base / "out")], timeout=60)
    assert result.returncode == 0, result.describe()
    reports = {}
    for r in range(n):
        path = Path(base / "out" / f"rank{r}.json")
        assert path.exists(), f"rank {r} reported nothing\n{result.describe()}"
        reports[r] = json.loads(path.read_text())
    return n, reports


def mismatch(r: int, n: int, failing: int, others_in: str, failing_in: str) -> str:
    """The pattern of the CollectiveMismatchError rank ``r`` raises, naming what each side called."""
    others = "rank 0" if n == 2 else f"ranks 0-{n - 2}"
    return (
        rf"^CollectiveMismatchError: rank {r}: ranks disagree on collective #\d+ .*"
        rf"{others}: #\d+ allreduce\(sum\) of '{re.escape(others_in)}' .*"
        rf"rank {failing}: #\d+ allreduce\(sum\) of '{re.escape(failing_in)}' "
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_call_after_one_that_failed_on_one_rank_works_and_nothing_is_lost(job, scenario):
    n, reports = job
    operation, failing, failure, as_is, left = SCENARIOS[scenario]
    failing = n - 1 if failing == "last" else failing
    verb = "save to" if operation == "save" else "restore from"
    for r, report in reports.items():
        calls = report[scenario]["calls"]
        outcomes = [outcome for _, outcome in calls]
        if left is not None and n > 1:  # the failing rank's next call met the others still in the failed one
            if r == failing:
                assert outcomes[0] == failure, (r, outcomes)
            assert re.search(mismatch(r, n, failing, *left), outcomes[-2]), (r, outcomes)
            assert len(outcomes) == (3 if r == failing else 2), (r, outcomes)
        elif r == failing and as_is:
            assert outcomes[0] == failure and len(outcomes) == 2, (r, outcomes)
        else:  # every rank learnt of the failure in the same step
            assert outcomes[0].startswith(f"CheckpointError: rank {r}: Checkpoint.{verb} "), (r, outcomes)
            assert outcomes[0].endswith(f"rank {failing}: {failure}") and len(outcomes) == 2, (r, outcomes)
        assert outcomes[-1] == "ok", (r, outcomes)
        assert all(seconds < SLOW for seconds, _ in calls), (r, calls)
        after = report[scenario]["after_failure"]
        assert after["saved"] == 1.0, (r, after)  # the earlier save is intact and still the newest
        if r == 0:
            assert after["hidden"] == [], after  # rank 0 removed the failed save's directory before returning
        final = report[scenario]
        if operation == "save":
            assert final["saves"] == ["ckpt-000002"] and final["newest"] == 2.0, (r, final)
        else:
            assert after["weights"] == 0.0 and after["position"] == 0, (r, after)  # nothing was modified
            assert final["weights"] == 1.0 and final["position"] == 1, (r, final)
