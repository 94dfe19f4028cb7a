"""``jobs/train.sbatch`` preempted on a real Slurm: submit, signal, requeue, compare with a run never stopped.

Shared by the one-node test (``tests/system/test_preemption_slurm.py``) and the two-node one
(``tests/system/test_multinode.py``); they pass the ``sbatch`` options of their cluster. The signal is
sent as ``--signal=B:USR1`` would send it (``scancel --signal=USR1 --batch``): the batch script
passes it on to the launcher, the ranks stop after the same step, save and exit, and the script
requeues the job. Slurm holds a requeued job back for about two minutes; the helpers release it
(``scontrol update StartTime=now``) once it is pending again. Every wait has a timeout.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Optional, TypeVar, Union

import numpy as np
import pytest

import mpidist as md
from test_slurm import FINAL_STATES, JOBS, REPO, _run as run, _scontrol_jobs as scontrol_jobs

WAIT = 180  # seconds for each phase of a job
T = TypeVar("T")


def job_env(slurm_env: Mapping[str, str], launcher: str) -> dict[str, str]:
    """The submitting environment of a job script: this virtual environment, ``launcher``, CPU mode."""
    env = dict(
        slurm_env, MPIDIST_VENV=sys.prefix, MPIDIST_LAUNCHER=launcher, MPIDIST_DEVICE="cpu", PYTHONDONTWRITEBYTECODE="1"
    )
    for key in ("MPIDIST_SRUN_MPI", "MPIDIST_MPIEXEC", "MPIDIST_JOBS"):
        env.pop(key, None)
    return env


def submit_training(
    env: Mapping[str, str], workdir: Path, name: str, checkpoints: Path, epochs: int, sbatch_args: list[str]
) -> str:
    """Submit ``train.sbatch`` for ``epochs`` epochs (output ``workdir/NAME-JOBID.out``); its job id.

    ``sbatch_args``: the cluster's options (nodes, tasks, cores, GPUs).
    """
    command = [
        "sbatch",
        "--parsable",
        f"--job-name=mpidist-test-{name}",
        "--time=5",
        f"--output={workdir}/{name}-%j.out",
        *sbatch_args,
        JOBS / "train.sbatch",
        "--epochs",
        epochs,
        "--checkpoint-dir",
        checkpoints,
        "--progress",
        "lines",
        "--data",
        "shipped",
    ]
    result = run(command, 60, env=env, cwd=REPO)
    assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
    return result.stdout.strip().split(";")[0]


def output(workdir: Path, name: str) -> str:
    files = sorted(workdir.glob(f"{name}-*.out"))
    return files[0].read_text(errors="replace") if files else ""


def until(what: Union[str, Callable[[], str]], check: Callable[[], T], timeout: float = WAIT) -> T:
    """Poll ``check()`` every 0.2 s until it returns something true; fail after ``timeout`` seconds.

    ``what`` names what was awaited; a callable is asked at the timeout, so the failure shows the
    state of things then (the job's output and fields), not when the wait began.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")


def final(env: Mapping[str, str], job_id: str, workdir: Path, name: str) -> dict[str, str]:
    """The job's fields once it reached a final state (``JobState=VANISHED`` if forgotten by then)."""

    def ended():
        fields = scontrol_jobs(env).get(job_id)
        if fields is None:
            return {"JobState": "VANISHED"}
        return fields if fields.get("JobState") in FINAL_STATES else None

    def state() -> str:
        return f"job {job_id} to end; its fields: {scontrol_jobs(env).get(job_id)}\n{output(workdir, name)}"

    return until(state, ended)


def training_started(workdir: Path, name: str, epochs: int, failed: Optional[re.Pattern] = None) -> str:
    """Wait until the job trains its third epoch (or its output matches ``failed``); its output."""

    def third_epoch():
        out = output(workdir, name)
        return out if re.search(rf"^epoch 3/{epochs}:", out, re.M) or (failed and failed.search(out)) else None

    return until("the job to train its third epoch", third_epoch)


def preempt_and_release(env: Mapping[str, str], job_id: str, workdir: Path, name: str) -> None:
    """Signal the batch script as ``--signal=B:USR1`` does; once the job requeued itself, release it."""
    signalled = run(["scancel", "--signal=USR1", "--batch", job_id], 30, env=env)
    assert signalled.returncode == 0, signalled.stderr
    release_requeued(env, job_id, workdir, name)


def release_requeued(env: Mapping[str, str], job_id: str, workdir: Path, name: str) -> None:
    """Wait until the job ``job_id`` requeued itself, then release it (Slurm holds it back two minutes)."""

    def requeued():
        fields = scontrol_jobs(env).get(job_id, {})
        assert fields.get("JobState") not in FINAL_STATES, f"{fields}\n{output(workdir, name)}"
        # released only once Slurm set its start time (Reason=BeginTime): the old run has ended
        return (
            fields.get("JobState") == "PENDING"
            and int(fields.get("Restarts", "0")) >= 1
            and fields.get("Reason") not in (None, "None")
        )

    until("the job to requeue itself", requeued)
    # slurmd refuses a job credential created within the same second as its revocation (Slurm
    # compares whole seconds, ctime <= revoked), which the end of the old run was: released at
    # once, the requeued job may fail at launch with "Job credential revoked".
    time.sleep(1.05 - time.time() % 1)
    released = run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], 30, env=env)
    assert released.returncode == 0, released.stderr


def requeue_resumes_to_the_uninterrupted_result(
    env: Mapping[str, str], job_id: str, workdir: Path, name: str, epochs: int, sbatch_args: list[str]
) -> None:
    """Preempt the training job ``job_id`` (checkpoints in ``workdir/NAME``), then assert the whole story.

    It stops on every rank at the same step, saves, requeues itself, resumes at the saved step and
    completes; then the same job, never stopped, ends with the same accuracy and, bit for bit, the
    same checkpoint. The caller cancels ``job_id`` should this fail.
    """
    preempt_and_release(env, job_id, workdir, name)
    fields = final(env, job_id, workdir, name)
    accuracy = _check_resumed(output(workdir, name), fields, epochs)
    reference = f"reference-{name}"
    ref_id = submit_training(env, workdir, reference, workdir / reference, epochs, sbatch_args)
    try:
        ref_fields = final(env, ref_id, workdir, reference)
    finally:
        run(["scancel", ref_id], 30, env=env)
    ref_output = output(workdir, reference)
    assert ref_fields.get("JobState") == "COMPLETED", ref_output[-6000:]
    assert "stop requested" not in ref_output
    assert re.search(r"final held-out accuracy: (\d+\.\d+)%", ref_output).group(1) == accuracy
    got, expected = md.read_checkpoint(workdir / name), md.read_checkpoint(workdir / reference)
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert int(got["epochs_done"]) == epochs


def _check_resumed(out: str, fields: Mapping[str, str], epochs: int) -> str:
    """Assert that the job completed after stopping, saving, requeueing and resuming at the saved step.

    Returns the final held-out accuracy it printed.
    """
    report = f"{fields.get('JobState')} {fields.get('ExitCode')}\n{out[-6000:]}"
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", report
    stop = re.search(rf"stop requested: every rank stopped in epoch (\d+)/{epochs} after step (\d+)/\d+, saved", out)
    assert stop, report
    epoch, step = int(stop.group(1)), int(stop.group(2))
    assert "requeueing job" in out, report
    assert re.search(rf"resumed from \S+ after epoch {epoch - 1} and step {step} of epoch {epoch}$", out, re.M), report
    assert re.search(rf"^epoch {epochs}/{epochs}:", out, re.M), report
    accuracy = re.search(r"final held-out accuracy: (\d+\.\d+)%", out)
    assert accuracy, report
    return accuracy.group(1)
