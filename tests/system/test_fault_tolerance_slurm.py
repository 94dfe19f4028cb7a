"""Dead ranks under a real Slurm (marker ``slurm``; the MPI side is ``tests/parallel/test_fault_tolerance.py``).

Submits ``jobs/train.sbatch`` with ``MPIDIST_FAULT_TOLERANCE=1`` on the test cluster of
``tests/system/test_slurm.py`` (2 tasks), rank 1 killed by SIGKILL in the second epoch (``kill_at``'s
hook, installed at start-up by ``tests/helpers/kill_at_start``: the script runs the program as a user
would). Under Open MPI's ``mpiexec --with-ft ulfm`` rank 0 trains on to the end alone; under ``srun``
Slurm ends the step; under MPICH the job ends. With ``MPIDIST_REGROW=1`` a job that shrank saves at the
end of the epoch, requeues itself and finishes from that checkpoint with all its ranks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import requeue
import test_slurm
from paths import HELPERS, REPO
from test_slurm import MPICH_START_FAILURE, TASKS, xfail_if_mpich_failed_to_start

cluster = test_slurm.cluster  # the Slurm of tests/system/test_slurm.py, a fixture

EPOCHS = 20  # the main job's default: its usual accuracy, in a few seconds
KILL = "1:agreement:150"  # rank 1, in the second epoch (the first takes about 130 agreements)
KILLWAIT = 30  # seconds: Slurm's default KillWait, between a step's SIGTERM and its SIGKILL


def submit(cluster, tmp_path: Path, name: str, launcher: str, **extra: str) -> tuple[str, Path]:
    """Submit the training with fault tolerance on and rank 1 to be killed; (job id, work folder)."""
    workdir = tmp_path / name
    workdir.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(workdir, 0o755)
    hook = os.pathsep.join([str(HELPERS / "kill_at_start"), str(HELPERS), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(
        requeue.job_env(cluster.env, launcher),
        MPIDIST_FAULT_TOLERANCE="1",
        MPIDIST_TEST_KILL=KILL,
        PYTHONPATH=hook,
        **extra,
    )
    sbatch_args = ["--nodes=1", f"--ntasks-per-node={TASKS}", "--cpus-per-task=1", *cluster.sbatch_args]
    job_id = requeue.submit_training(env, workdir, name, workdir / "ckpt", EPOCHS, sbatch_args)
    return job_id, workdir


def report(fields: dict, out: str) -> str:
    return f"JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')}\n--- output ---\n{out[-6000:]}"


def ended(cluster, tmp_path: Path, name: str, launcher: str) -> tuple[dict, str]:
    """Submit, wait for the end: (the job's final fields, its output)."""
    job_id, workdir = submit(cluster, tmp_path, name, launcher)
    try:
        fields = requeue.final(cluster.env, job_id, workdir, name)
    finally:
        requeue.run(["scancel", job_id], 30, env=cluster.env)  # a no-op once it ended
    return fields, requeue.output(workdir, name)


def run_seconds(fields: dict) -> int:
    """How long the job ran (its ``RunTime``, ``[D-]HH:MM:SS``)."""
    days, _, clock = fields["RunTime"].rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def died_at_a_step(out: str, fields: dict, launcher: str) -> None:
    """Assert that training ran until the kill (else the known MPICH start failure is an expected failure)."""
    if MPICH_START_FAILURE.search(out):
        xfail_if_mpich_failed_to_start(out, launcher)
    assert re.search(rf"^epoch 1/{EPOCHS}:", out, re.M), report(fields, out)


@pytest.mark.slurm
def test_mpiexec_job_finishes_on_the_survivors(cluster, tmp_path):
    """Open MPI: the job trains on without rank 1 to the usual accuracy, and says so; MPICH: the job ends."""
    fields, out = ended(cluster, tmp_path, "ft-mpiexec", "mpiexec")
    died_at_a_step(out, fields, "mpiexec")
    if test_slurm._mpi_flavour() == "mpich":  # no ULFM: its launcher ends the job at once
        assert fields.get("JobState") == "FAILED" and "final held-out accuracy" not in out, report(fields, out)
        assert "BAD TERMINATION" in out, report(fields, out)
        return
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", report(fields, out)
    assert "rank 1 died; 1 rank carries on from epoch 2" in out, report(fields, out)
    final = out.strip().splitlines()[-1]
    assert final.startswith("final held-out accuracy: "), report(fields, out)
    assert f"(359 images, 1 rank, after rank 1 died, {EPOCHS} epochs" in final, report(fields, out)
    assert float(re.search(r"accuracy: (\d+\.\d+)%", final).group(1)) >= 95.0, report(fields, out)


@pytest.mark.slurm
def test_srun_ends_the_step_when_a_rank_dies(cluster, tmp_path):
    """srun cannot keep the survivors: the job fails soon after the kill, saying why at its start, and never hangs."""
    fields, out = ended(cluster, tmp_path, "ft-srun", "srun")
    died_at_a_step(out, fields, "srun")
    assert fields.get("JobState") == "FAILED" and "final held-out accuracy" not in out, report(fields, out)
    assert re.search(r"STEP \d+\.\d+ ON \S+ CANCELLED", out), report(fields, out)  # Slurm ended the step
    if test_slurm._mpi_flavour() == "openmpi":
        assert "MPIDIST_FAULT_TOLERANCE=1 cannot work under srun" in out, report(fields, out)
    else:
        assert "this MPI cannot carry on after a rank dies" in out, report(fields, out)
    # srun sends the step SIGTERM, which the survivor takes for a request to stop (one that a dead rank never
    # joins), then SIGKILL KillWait seconds later
    assert run_seconds(fields) < KILLWAIT + 20, report(fields, out)


@pytest.mark.slurm
def test_a_shrunk_job_requeues_itself_and_finishes_at_full_size(cluster, tmp_path):
    """MPIDIST_REGROW=1: the job goes on alone to the end of the epoch, saves, requeues itself, and its next
    run resumes from that checkpoint with both ranks and ends with the usual accuracy."""
    name = "regrow"
    job_id, workdir = submit(cluster, tmp_path, name, "mpiexec", MPIDIST_REGROW="1")
    try:
        if test_slurm._mpi_flavour() == "mpich":  # nothing to regrow: the job ends, and is not requeued
            fields = requeue.final(cluster.env, job_id, workdir, name)
            out = requeue.output(workdir, name)
            died_at_a_step(out, fields, "mpiexec")
            assert fields.get("JobState") == "FAILED" and fields.get("Restarts") == "0", report(fields, out)
            return
        requeue.release_requeued(cluster.env, job_id, workdir, name)
        fields = requeue.final(cluster.env, job_id, workdir, name)
    finally:
        requeue.run(["scancel", job_id], 30, env=cluster.env)
    out = requeue.output(workdir, name)
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", report(fields, out)
    assert fields.get("Restarts") == "1", report(fields, out)
    first, _, second = out.partition(f"requeueing job {job_id} to resume with all {TASKS} ranks")
    assert second, report(fields, out)
    assert "rank 1 died; 1 rank carries on from epoch 2" in first, report(fields, out)
    stop = re.search(
        rf"^regrow: 1 of {TASKS} ranks left, after rank 1 died; stopped after epoch (\d+)/{EPOCHS}, "
        rf"saved (ckpt-\d+); exit status 75",
        first,
        re.M,
    )
    assert stop, report(fields, out)
    assert not re.search(rf"^epoch {int(stop.group(1)) + 1}/", first, re.M), report(fields, out)  # it stopped there
    assert f"mpidist doctor: {TASKS} ranks on 1 node" in second, report(fields, out)
    assert re.search(rf"^resumed from \S+/{stop.group(2)} after epoch {stop.group(1)}$", second, re.M), report(
        fields, out
    )
    final = second.strip().splitlines()[-1]
    assert final.startswith("final held-out accuracy: "), report(fields, out)
    assert f"(359 images, {TASKS} ranks, {EPOCHS} epochs" in final, report(fields, out)
    assert float(re.search(r"accuracy: (\d+\.\d+)%", final).group(1)) >= 95.0, report(fields, out)
