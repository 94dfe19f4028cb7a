"""Surviving dead ranks (api-contract C9), checked on whole jobs: a rank is killed (SIGKILL) at a counted moment.

Each test starts ``tests/helpers/samples/ft_job.py`` with ``MPIDIST_FAULT_TOLERANCE=1`` through
``jobs/mpirun.sh`` (which adds ``--with-ft ulfm`` for Open MPI) at 3 and 4 ranks, the last rank
or rank 1 killed by ``kill_at`` before an agreement, inside a pipelined reduction or inside a
step of mirrored updates. Under Open MPI every survivor raises ``RankFailedError`` naming the
dead rank, recovers and finishes with the same values; MPICH cannot continue, and its launcher
ends the job.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from mpirun import find_mpiexec, mpi_flavour, run_command
from paths import HELPERS, JOBS, REPO, SAMPLES

JOB = str(SAMPLES / "ft_job.py")
# The main job, run after kill_at's hook is installed (MPIDIST_TEST_KILL says which rank dies where)
MAIN_JOB = (
    "import kill_at, runpy; kill_at.install(); runpy.run_module('mpidist.examples.train_digits', run_name='__main__')"
)
OPEN_MPI = mpi_flavour(find_mpiexec()[0]) == "openmpi"


def launch(n, scenario, kill, out, node_size=0, **extra):
    """Run the job at ``n`` ranks with ``MPIDIST_TEST_KILL=kill`` (and the environment's ``extra`` variables):
    (result, {first rank: outcome}, time of the kill)."""
    stamp = out / "killed-at"
    env = {
        **os.environ,
        "FT_OUT": str(out),
        "MPIDIST_FAULT_TOLERANCE": "1",
        "MPIDIST_TEST_KILL": kill,
        "MPIDIST_TEST_KILL_STAMP": str(stamp),
        "FT_NODE_SIZE": str(node_size),
        "PYTHONPATH": os.pathsep.join([str(HELPERS), str(REPO), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }
    result = run_command(["bash", str(JOBS / "mpirun.sh"), "-n", str(n), sys.executable, JOB, scenario], 120, env=env)
    seen = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(out).glob("rank*.json")}
    return result, seen, float(stamp.read_text()) if stamp.exists() else None


CASES = [
    # (scenario, the rank killed, what is counted, at which count, ranks per "node" of a two-level reduction)
    ("allreduce", "last", "agreement", 9, 0),  # before an agreement: in the fifth step's reduction
    ("allreduce", "1", "agreement", 8, 0),  # a middle rank: the survivors are renumbered
    ("pipelined", "last", "piece", 100, 0),  # inside the second 8 MiB reduction, 64 pieces of 128 KiB each
    ("pipelined", "1", "piece", 100, 2),  # the same, two-level: the node and leader communicators are rebuilt
    ("pipelined", "2", "agreement", 9, 2),  # a node's leader, before an agreement
    ("mirrored", "last", "agreement", 12, 0),  # between the two updates of a step
    ("mirrored", "1", "agreement", 13, 0),  # inside the second update of a step
    ("mirrored", "0", "agreement", 12, 0),  # rank 0: every survivor moves down one
    ("checkpoint", "last", "agreement", 28, 0),  # inside a checkpoint save, as the ranks write their parts
    ("checkpoint", "2", "agreement", 30, 0),  # inside a save, as it commits
    ("checkpoint", "0", "agreement", 30, 0),  # rank 0, which commits the saves
    ("input", "1", "agreement", 17, 0),  # mid-epoch over a distributed dataset: the position is re-sharded
    ("inplace", "last", "piece", 100, 0),  # an in-place 8 MiB allreduce: its buffer as it was, on every survivor
    ("inplace", "1", "piece", 20, 0),
    ("update", "last", "piece", 100, 0),  # an 8 MiB mirrored update, no snapshot: whole or not at all
    ("update", "1", "piece", 37, 0),
    ("compressed", "last", "call", 40, 0),  # a float32 update sent in bfloat16, inside its exchanges
    ("compressed", "1", "call", 51, 0),
]


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize(("scenario", "victim", "what", "count", "node_size"), CASES)
def test_survivors_carry_on(n, scenario, victim, what, count, node_size, tmp_path):
    dead = n - 1 if victim == "last" else int(victim)
    result, seen, killed_at = launch(n, scenario, f"{dead}:{what}:{count}", tmp_path, node_size)
    assert killed_at is not None, result.describe()  # the hook fired
    if not OPEN_MPI:  # MPICH: no survivors; the launcher ends the job, promptly
        assert result.returncode not in (0, None), result.describe()
        assert result.elapsed < 60, result.describe()
        return
    assert result.returncode == 0, result.describe()
    survivors = [r for r in range(n) if r != dead]
    assert sorted(seen) == survivors, result.describe()
    for old, outcome in seen.items():
        assert outcome["final_size"] == n - 1 and outcome["final_rank"] == survivors.index(old), outcome
        [failure] = outcome["failures"]
        assert failure["failed_ranks"] == [dead] and failure["size"] == n - 1, failure
        assert f"rank {dead} died" in failure["message"] and failure["message"].startswith(f"rank {old}: "), failure
        # noticed within moments of the death, not at the deadline (60 s), and carried on at once
        assert failure["raised_at"] - killed_at < 5.0, failure
        assert outcome["check"] == {}, outcome  # every mirrored variable the same on every survivor
    if scenario in ("mirrored", "checkpoint"):  # eight steps of a += s, b += 2 s, each exactly once
        assert {(o["a"], o["b"]) for o in seen.values()} == {(36.0, 72.0)}, seen
        if scenario == "mirrored":  # the metric the dead rank held part of says so when read, until reset
            for o in seen.values():
                assert len(o["lost"]) == 1 and f"lacks the part of rank {dead}, which died" in o["lost"][0], o
                assert o["lost_after_reset"] == [], o
        if scenario == "checkpoint":  # and the newest save holds them
            assert all(o["restored"] == [36.0, 72.0] for o in seen.values()), seen
    elif scenario in (
        "inplace",
        "update",
        "compressed",
    ):  # the call that raised wrote nothing; every variable whole and alike
        assert all(o["buffer"] == [1.0, 1.0] for o in seen.values()), seen
        assert len({tuple(o["whole"]) for o in seen.values()}) == 1, seen
        assert all(lo == hi for lo, hi in (o["whole"] for o in seen.values())), seen
    elif scenario == "input":  # three epochs of ten steps, none lost or repeated; the same slope everywhere
        assert {o["a"] for o in seen.values()} == {30.0}, seen
        assert len({o["b"] for o in seen.values()}) == 1 and abs(next(iter(seen.values()))["b"] - 3.0) < 1e-3, seen
    else:  # every step's sum counts the ranks alive when it completed, and no step is lost or repeated
        for outcome in seen.values():
            steps = [s for s, *_ in outcome["sums"]]
            assert steps == list(range(8)), outcome["sums"]
            assert all(lo == hi == size for _, lo, hi, size in outcome["sums"]), outcome["sums"]
            assert {size for *_, size in outcome["sums"]} == {n, n - 1}, outcome["sums"]


def test_a_death_during_the_recovery_is_recovered_from_and_its_metric_part_counted_lost(tmp_path):
    """Rank 1 of 4 killed inside a step, rank 3 as it would call recover(): ranks 0 and 2 meet the second death
    inside their recovery, recover from it too and finish every step once; the metric says it lacks the parts of
    both dead ranks (numbered as the RankFailedError the program caught names them), not only the first's."""
    result, seen, _ = launch(4, "mirrored", "1:agreement:13", tmp_path, FT_DIE_IN_RECOVERY="3")
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    assert result.returncode == 0 and sorted(seen) == [0, 2], result.describe()
    for old, outcome in seen.items():
        assert outcome["final_size"] == 2 and outcome["final_rank"] == [0, 2].index(old), outcome
        [failure] = outcome["failures"]
        assert failure["failed_ranks"] == [1] and failure["size"] == 3, failure
        assert outcome["check"] == {} and (outcome["a"], outcome["b"]) == (36.0, 72.0), outcome
        [lost] = outcome["lost"]
        assert "lacks the parts of ranks 1, 3, which died" in lost, outcome


def test_a_metric_names_the_ranks_lost_in_two_failures_as_the_strategy_numbered_them(tmp_path):
    """Rank 1 of 4 killed, the survivors recover; then rank 3 (rank 2 of the 3 survivors) dies: the metric, not
    reset in between, lacks the parts of ranks 1 and 3 and names them so, not rank 2, which is alive."""
    result, seen, _ = launch(4, "mirrored", "1:agreement:13", tmp_path, FT_DIE_AFTER_RECOVERY="3")
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    assert result.returncode == 0 and sorted(seen) == [0, 2], result.describe()
    for outcome in seen.values():
        assert [f["failed_ranks"] for f in outcome["failures"]] == [[1], [2]], outcome  # each as numbered before it
        assert outcome["check"] == {} and (outcome["a"], outcome["b"]) == (36.0, 72.0), outcome
        [lost] = outcome["lost"]
        assert "lacks the parts of ranks 1, 3, which died (numbered as when the strategy was created)" in lost, lost


def test_the_strategy_refuses_collectives_until_it_recovered(tmp_path):
    """Survivors that call the strategy's collectives before recover() (a reduction, a mirrored update, a
    metric's read) get the RankFailedError again, naming the dead rank and recover(), and nothing runs; after
    recover() every step lands exactly once."""
    result, seen, _ = launch(4, "mirrored", "1:agreement:13", tmp_path, FT_COLLECTIVES_BEFORE_RECOVERY="1")
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    assert result.returncode == 0 and sorted(seen) == [0, 2, 3], result.describe()
    for outcome in seen.values():
        assert len(outcome["refused"]) == 3 and "ran" not in outcome["refused"], outcome
        for failed, message in outcome["refused"]:
            assert failed == [1] and "has not recovered yet: every survivor calls strategy.recover()" in message
        assert outcome["check"] == {} and (outcome["a"], outcome["b"]) == (36.0, 72.0), outcome


@pytest.mark.parametrize("count", [9, 10])  # rank 3 killed in its set's collective, or in the whole's
def test_process_sets_recover_each_on_its_own(count, tmp_path):
    """Sets {0, 1} and {2, 3}, rank 3 killed: the set that lost it and the whole strategy each raise in their own
    collective and recover on their own (``recover()`` on the strategy whose call raised); the other set goes on."""
    result, seen, _ = launch(4, "split", f"3:agreement:{count}", tmp_path)
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    assert result.returncode == 0 and sorted(seen) == [0, 1, 2], result.describe()
    recovered_at = set()
    for old, outcome in seen.items():
        for name, dead, size_before, size_after in (("all", [3], 4, 3), ("set", [1], 2, 1)):
            rows = [next(r for r in row[1:] if r[0] == name) for row in outcome["split"]]
            if name == "set" and old < 2:  # the other set never noticed
                assert rows == [["set", 2.0, 2]] * 6, outcome["split"]
                continue
            [at] = [i for i, r in enumerate(rows) if r[1] == "recovered"]
            assert rows[at] == [name, "recovered", dead, size_after], rows
            assert rows[:at] == [[name, float(size_before), size_before]] * at, rows
            assert rows[at + 1 :] == [[name, float(size_after), size_after]] * (5 - at), rows
            if name == "all":
                recovered_at.add(at)
    assert len(recovered_at) == 1, seen  # the whole strategy recovered in the same step on every survivor


def test_survivors_stuck_in_the_shrink_stop_at_the_timeout(tmp_path):
    """MPI's shrink never returns on the survivors (seen on the side of a cut link): at the strategy's timeout
    (3 s here) each survivor says so and ends as a dead rank would, and the job ends, never hangs; its launcher's
    exit status 0 (every rank killed) becomes jobs/mpirun.sh's 1."""
    result, seen, _ = launch(3, "stuck", "2:agreement:9", tmp_path)
    assert result.returncode not in (0, None), result.describe()
    if not OPEN_MPI:  # MPICH: the launcher ends the job first
        return
    assert seen == {} and result.elapsed < 30, result.describe()
    assert "but no rank's program ended normally" in result.stderr, result.describe()
    for rank in (0, 1):
        message = f"[rank {rank}] rank {rank}: the survivors did not rebuild the communicator within 3 s after"
        assert message in result.stderr, result.describe()


def test_a_timeline_goes_on_over_the_survivors(tmp_path):
    """With a timeline, the survivors record on into their files (a track for their new communicator), and the
    ranks' files, the dead rank's with them, merge."""
    timeline = tmp_path / "timeline"
    result, seen, _ = launch(3, "allreduce", "2:agreement:9", tmp_path, MPIDIST_TIMELINE=str(timeline))
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    assert result.returncode == 0 and sorted(seen) == [0, 1], result.describe()
    for rank in (0, 1):
        text = (timeline / f"timeline-rank{rank}.json").read_text()
        assert f"(rank {rank} of 3)" in text and f"(rank {rank} of 2)" in text, text[:2000]
    merged = run_command([sys.executable, "-m", "mpidist", "timeline", str(timeline)], 60, env=dict(os.environ))
    assert merged.returncode == 0, merged.describe()
    assert (timeline / "timeline.json").exists(), merged.describe()


def test_main_job_finishes_on_the_survivors(tmp_path):
    """The main job at 4 ranks, rank 3 killed in the second epoch: it trains on to the usual accuracy on 3 ranks."""
    env = {
        **os.environ,
        "MPIDIST_FAULT_TOLERANCE": "1",
        "MPIDIST_TEST_KILL": "3:agreement:150",  # the first epoch takes about 130 agreements
        "PYTHONPATH": os.pathsep.join([str(HELPERS), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-c", MAIN_JOB, "--progress", "lines", "--checkpoint-dir", str(tmp_path / "ckpt")]
    result = run_command(["bash", str(JOBS / "mpirun.sh"), "-n", "4", *argv, "--min-accuracy", "95"], 300, env=env)
    if not OPEN_MPI:  # MPICH: the launcher ends the job
        assert result.returncode not in (0, None), result.describe()
        return
    assert result.returncode == 0, result.describe()
    lines = result.stdout.strip().splitlines()
    assert "epoch 1/20:" in result.stdout and "rank 3 died; 3 ranks carry on from epoch 2" in result.stdout
    assert lines[-1].startswith("final held-out accuracy: "), result.describe()
    assert "(359 images, 3 ranks, after rank 3 died, 20 epochs" in lines[-1], result.describe()


def test_main_job_regrow_stops_after_the_epoch_and_resumes_at_full_size(tmp_path):
    """--regrow: rank 2 of 3 killed in the second epoch, the survivors save at its end and exit 75; the job
    started again with --resume continues from that checkpoint on 3 ranks to the usual accuracy."""
    env = {
        **os.environ,
        "MPIDIST_FAULT_TOLERANCE": "1",
        "PYTHONPATH": os.pathsep.join([str(HELPERS), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable,
        "-c",
        MAIN_JOB,
        "--progress",
        "lines",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--resume",
    ]
    launch = ["bash", str(JOBS / "mpirun.sh"), "-n", "3", *argv, "--regrow", "--min-accuracy", "95"]
    shrunk = run_command(launch, 300, env={**env, "MPIDIST_TEST_KILL": "2:agreement:150"})
    if not OPEN_MPI:  # MPICH: the launcher ends the job; nothing to regrow
        assert shrunk.returncode not in (0, 75, None), shrunk.describe()
        return
    assert shrunk.returncode == 75, shrunk.describe()
    assert "rank 2 died; 2 ranks carry on from epoch 2" in shrunk.stdout, shrunk.describe()
    last = shrunk.stdout.strip().splitlines()[-1]
    assert last.startswith("regrow: 2 of 3 ranks left, after rank 2 died; stopped after epoch 2/20, saved ckpt-000002;")
    assert "epoch 3/20" not in shrunk.stdout, shrunk.describe()
    again = run_command(launch, 300, env=env)
    assert again.returncode == 0, again.describe()
    assert "resumed from " in again.stdout and "ckpt-000002 after epoch 2\n" in again.stdout, again.describe()
    assert "(359 images, 3 ranks, 20 epochs" in again.stdout.strip().splitlines()[-1], again.describe()


def test_without_fault_tolerance_every_survivor_gets_a_clear_error(tmp_path):
    """Launched to survive, but the strategy's fault tolerance off: a CommError naming the death, never MPI's own."""
    result, seen, _ = launch(4, "off", "3:agreement:9", tmp_path)
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    assert sorted(seen) == [0, 1, 2], result.describe()
    for old, outcome in seen.items():
        error = outcome["error"]
        assert error.startswith(f"CommError: rank {old}: "), error
        assert "of this communicator died" in error and "fault tolerance is off" in error, error
    assert any("rank 3 of this communicator died" in o["error"] for o in seen.values()), seen


@pytest.mark.parametrize(
    ("dead", "named", "carry_on"), [("0,1", "0-1", False), ("2,3", "2-3", True), ("0,1,2", "0-2", False)]
)
def test_only_the_side_with_a_majority_or_half_with_rank_0_carries_on(dead, named, carry_on, tmp_path):
    """Half of the ranks die (or are cut off): the half with rank 0 carries on, the other half stops quietly."""
    result, seen, _ = launch(4, "allreduce", f"{dead}:agreement:9", tmp_path)
    if not OPEN_MPI:
        assert result.returncode not in (0, None), result.describe()
        return
    left = [r for r in range(4) if str(r) not in dead.split(",")]
    assert result.returncode is not None, result.describe()  # no hang
    if carry_on:
        assert result.returncode == 0 and sorted(seen) == left, result.describe()
        assert all(o["final_size"] == len(left) for o in seen.values()), seen
        return
    assert seen == {}, seen  # nobody went on
    for rank in left:  # each stopped with the error saying why, without aborting the job
        assert f"[rank {rank}] mpidist._errors.CutOffError: rank {rank}: ranks {named} of the 4 died" in result.stderr
    assert "aborting the job so the other ranks do not hang" not in result.stderr, result.describe()


@pytest.mark.parametrize("n", [3, 4])
def test_an_uncaught_rank_failed_error_ends_the_job(n, tmp_path):
    """A death while the variables are made (outside the program's try): every survivor's RankFailedError is
    uncaught, and the job ends with a failing status instead of leaving the launcher behind."""
    result, seen, _ = launch(n, "input", f"{n - 1}:agreement:3", tmp_path)
    assert result.returncode not in (0, None), result.describe()
    assert result.elapsed < 30 and seen == {}, result.describe()
    if OPEN_MPI:
        assert "uncaught RankFailedError on rank 0" in result.stderr, result.describe()
