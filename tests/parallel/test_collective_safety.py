"""Collective safety on whole jobs (2 and 3 ranks; a marked subset at 8 ranks, oversubscribed).

Each test launches ``tests/helpers/samples/safety_job.py`` under a real ``mpiexec`` with
``abort_on_error`` off and every error caught, so what ends each case is
mpidist's agreement itself: the rank with the bad argument raises its own
error, every other rank a :class:`~mpidist.CollectiveMismatchError` naming it;
a rank that stays away is named when the deadline passes; a rank that leaves
is named at once. Expected texts derive from the rank and the size; time
bounds are the job's subprocess timeout and the elapsed time each rank reports.
"""

import os
import sys
from pathlib import Path

import pytest

from mpirun import run_mpi
from paths import SAMPLES

JOB = str(SAMPLES / "safety_job.py")
RANKS = [2, 3, pytest.param(8, marks=pytest.mark.ranks8)]


def launch(
    n: int, scenario: str, out_dir: Path, timeout: float = 60, failed: bool = False
) -> dict[int, dict[str, tuple[float, str]]]:
    """Run the scenario at ``n`` ranks (a job that ``failed`` ends with a status other than 0); every rank's
    {case: (seconds, outcome)}."""
    result = run_mpi(n, [sys.executable, JOB, scenario, str(out_dir)], timeout=timeout, env=dict(os.environ))
    assert result.returncode is not None and (result.returncode != 0) == failed, result.describe()
    seen = {}
    for r in range(n):
        path = out_dir / f"rank{r}.txt"
        assert path.exists(), f"rank {r} reported nothing\n{result.describe()}"
        rows = [line.split(" ", 2) for line in path.read_text().splitlines()]
        seen[r] = {case: (float(seconds), outcome) for case, seconds, outcome in rows}
    return seen


BAD_ARGUMENTS = {  # case: (the bad rank's error type, words of its message)
    "unknown_op": ("ValueError", "unknown reduce op"),
    "out_shape": ("ValueError", "out= must have the input's shape"),
    "inplace_and_out": ("ValueError", "either inplace=True or out="),
    "read_only": ("ValueError", "read-only"),
    "byte_order": ("TypeError", "non-native byte order"),
    "broadcast_root": ("ValueError", "is not a rank"),
    "reduce_scatter_counts": ("ValueError", "counts"),
    "update_shape": ("ValueError", "cannot update variable 'a'"),
    "reduce_op": ("ValueError", "unknown reduce op"),
}


@pytest.mark.parametrize("n", [2, 3])
def test_a_bad_argument_on_one_rank_is_an_error_on_every_rank(n, tmp_path):
    seen = launch(n, "bad_arguments", tmp_path)
    bad = n - 1
    for case, (kind, words) in BAD_ARGUMENTS.items():
        seconds, outcome = seen[bad][case]
        assert outcome.startswith(f"{kind}: rank {bad}: ") and words in outcome, (case, outcome)
        for r in range(n - 1):
            seconds, outcome = seen[r][case]
            assert outcome.startswith(f"CollectiveMismatchError: rank {r}: "), (case, r, outcome)
            assert f"rank {bad}: #" in outcome and "could not take part" in outcome, (case, outcome)
            assert words in outcome, (case, outcome)
            assert seconds < 15, (case, seconds)
    for r in range(n):  # nothing was broken: the next collective works
        assert seen[r]["after"][1] == f"ok {float(n)}"


def site(marker: str) -> str:
    """``file:line`` of the line of the job marked ``# site: <marker>``, as mpidist names a call there."""
    lines = Path(JOB).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, start=1) if text.endswith(f"# site: {marker}"))
    return f"{os.path.relpath(JOB)}:{line}"


@pytest.mark.parametrize("n", RANKS)
def test_mismatches_are_errors_on_every_rank_naming_both_sides(n, tmp_path):
    seen = launch(n, "mismatch", tmp_path)
    others = f"ranks 0-{n - 2}" if n > 2 else "rank 0"
    words = {
        "shape": ("float64[2]", "float64[3]"),
        "different_variable": ("'a'", "'b'"),
        "variable_name": ("'weights'", "'bias'"),
        "empty_nest": ("2 arrays", "0 arrays"),
        "reduce_scatter_counts_differ": ("counts",),
        # each group's call site
        "call_sites": (
            f"{others}: #{{}} allreduce(sum) of 'array' float64[2] at {site('mismatch good')}",
            f"rank {n - 1}: #{{}} broadcast(root=0) of 'array' float64[2] at {site('mismatch bad')}",
        ),
    }
    for r in range(n):
        for case, expected in words.items():
            seconds, outcome = seen[r][case]
            assert outcome.startswith(f"CollectiveMismatchError: rank {r}: ranks disagree"), (case, r, outcome)
            number = outcome.split("#", 1)[1].split(" ", 1)[0]
            assert all(w.format(number) in outcome for w in expected) and seconds < 15, (case, outcome)
        assert f"{others}: #" in seen[r]["shape"][1] and f"rank {n - 1}: #" in seen[r]["shape"][1]
        assert seen[r]["after"][1] == f"ok {float(n)}"


@pytest.mark.parametrize("n", [2, 3])  # the test names the waiting ranks' lines for 2 and 3
def test_a_stall_says_where_every_rank_is_in_the_warning_and_at_the_deadline(n, tmp_path):
    """The last rank is late past the warning, then past the deadline: the others name their own lines and the
    line of the late rank's last collective."""
    seen = launch(n, "stall", tmp_path, failed=True)  # a caught deadline error fails the job
    bad = n - 1
    call = "(#{} allreduce(sum) of 'grads' float64[3])"
    waiting = [f"rank 0 waits at {site('wait 0')} {call}"] + (
        [f"rank 1 waits at {site('wait')} {call}"] if n > 2 else []
    )
    late = (
        f"rank {bad} has not answered (outside mpidist, or unreachable), last seen in #{{}} broadcast(root=0) of "
        f"'w' float64[2], a call this rank first made at {site('last seen')}"
    )
    for r in range(n):
        assert seen[r]["warning"][1] == f"ok [{n}. {n}. {n}.]"  # the late rank arrived before the deadline
    for r in range(n - 1):
        line = site("wait 0" if r == 0 else "wait").rsplit(":", 1)[1]
        for phase in ("warning", "deadline"):
            warning = seen[r][f"{phase}-warning"][1]  # shown at the line of the program's call
            number = int(warning.split("(collective #", 1)[1].split(")", 1)[0])
            assert warning.startswith(f"{JOB}:{line}: rank {r}: still waiting after"), warning
            assert all(w.format(number) in warning for w in waiting) and late.format(number - 1) in warning, warning
        seconds, outcome = seen[r]["deadline"]
        assert outcome.startswith(f"CollectiveTimeoutError: rank {r}: allreduce(sum) of 'grads' float64[3]"), outcome
        assert all(w.format(number) in outcome for w in waiting) and late.format(number - 1) in outcome, outcome
        assert 2 <= seconds < 3.5, (seconds, outcome)  # the deadline and its grace: a doubled deadline fails


@pytest.mark.parametrize("n", RANKS)
def test_a_rank_that_stays_away_is_named_at_the_deadline(n, tmp_path):
    seen = launch(n, "deadline", tmp_path, timeout=3 + 10 + 20, failed=True)  # a caught deadline error fails the job
    bad = n - 1
    assert seen[bad]["deadline"][1] == "ok stayed away"
    for r in range(n - 1):
        seconds, outcome = seen[r]["deadline"]
        assert outcome.startswith(f"CollectiveTimeoutError: rank {r}: "), outcome
        # the deadline plus its grace (0.3 s), with room for 8 ranks on 2 cores: a doubled deadline fails
        assert f"rank {bad} has not answered" in outcome and 3 <= seconds <= 5.5, (seconds, outcome)


@pytest.mark.parametrize("n", RANKS)
def test_a_rank_that_exits_early_is_named_at_once(n, tmp_path):
    seen = launch(n, "early_exit", tmp_path)  # default settings: the deadline is minutes away
    bad = n - 1
    assert seen[bad]["early_exit"][1] == "ok left"
    for r in range(n - 1):
        seconds, outcome = seen[r]["early_exit"]
        assert outcome.startswith(f"RankLeftError: rank {r}: rank {bad} left the job"), outcome
        assert seconds < 10, seconds


@pytest.mark.parametrize("n", [2, 3])
def test_nonblocking_calls_return_at_once_and_keep_their_buffers(n, tmp_path):
    seen = launch(n, "nonblocking", tmp_path)
    total = float(sum(r + 1 for r in range(n)))
    for r in range(n):
        _, outcome = seen[r]["nonblocking"]
        returned = float(outcome.split("returned=")[1].split()[0])
        assert outcome.endswith(f"sum={[total] * 4}"), outcome
        assert returned < 1.0, outcome  # while rank n-1 is 1.5 s late
