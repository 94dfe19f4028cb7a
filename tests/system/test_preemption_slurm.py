"""Coordinated stops under a real Slurm (marker ``slurm``; the MPI side is ``tests/parallel/test_preemption.py``).

Submits ``jobs/train.sbatch``, signals it as ``--signal=B:USR1`` would, and checks that it saves,
requeues itself, resumes at the saved step and ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import requeue
import test_slurm
from test_slurm import MPICH_START_FAILURE, TASKS, xfail_if_mpich_failed_to_start

cluster = test_slurm.cluster  # the Slurm of tests/system/test_slurm.py, a fixture

EPOCHS = 150  # long enough (several seconds) to be signalled while it trains


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_signalled_job_saves_requeues_and_resumes_to_the_same_result(cluster, launcher, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"preempt-{launcher}")
    os.chmod(workdir, 0o755)
    name, env = f"preempt-{launcher}", requeue.job_env(cluster.env, launcher)
    sbatch_args = ["--nodes=1", f"--ntasks-per-node={TASKS}", "--cpus-per-task=1", *cluster.sbatch_args]
    job_id = requeue.submit_training(env, workdir, name, workdir / name, EPOCHS, sbatch_args)
    try:
        started = requeue.training_started(workdir, name, EPOCHS, failed=MPICH_START_FAILURE)
        if MPICH_START_FAILURE.search(started):
            xfail_if_mpich_failed_to_start(started, launcher)
        if launcher == "srun" and test_slurm._mpi_flavour() == "mpich":
            leave_a_killed_steps_segment(job_id)
        requeue.requeue_resumes_to_the_uninterrupted_result(env, job_id, workdir, name, EPOCHS, sbatch_args)
    finally:
        requeue.run(["scancel", job_id], 30, env=env)  # a no-op once it ended


def mpich_segment_hash(step_name: str) -> str:
    """The hash in MPICH's shared-memory names for the srun step ``<job id>.<step id>`` (32-bit FNV-1a)."""
    value = 2166136261
    for byte in step_name.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return f"{value:x}"


def leave_a_killed_steps_segment(job_id: str) -> None:
    """Leave, under the name of the requeued run's first step, the segment a killed step leaves behind.

    The training (step 1 of this run: ``mpidist doctor`` is step 0) holds its segment now; a copy
    named after step 0 is what a step 0 killed before MPI_Finalize would have left. The requeued
    run numbers its steps from 0 again: unless ``jobs/launch.sh`` removes the copy, its first step
    joins it and MPI_Init hangs or fails.
    """
    live = sorted(Path("/dev/shm").glob(f"mpich_shm_{mpich_segment_hash(f'{job_id}.1')}_*"))
    assert live, f"no shared-memory segment of step {job_id}.1 in /dev/shm"
    for segment in live:
        node = segment.name.rsplit("_", 1)[1]
        shutil.copyfile(segment, segment.with_name(f"mpich_shm_{mpich_segment_hash(f'{job_id}.0')}_{node}"))
