"""Coordinated stops: a stop requested on some ranks is seen by every rank at the same step.

MPI tests (1, 2 and 3 ranks): with collective checks on, the request rides the next
agreement record; with every check off, ``should_stop(check_every=k)`` checks every k-th call.
Serial tests: signal names, and a one-rank world. The system test (marker ``slurm``)
submits ``jobs/train.sbatch`` to a real Slurm, signals it as ``--signal=B:USR1`` would, and
checks that it saves, requeues itself, resumes at the saved step and ends with the same
weights as an uninterrupted run.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import numpy as np
import pytest

import mpidist as md
from mpidist._distribute.preemption import signal_numbers
from test_slurm import (FINAL_STATES, JOBS, MPICH_START_FAILURE, REPO, TASKS, _run, _scontrol_jobs, cluster,
                        xfail_if_mpich_failed_to_start)  # noqa: F401 (a fixture)

STEPS = 20


def _loop(strategy, request_at, requester, check_every=10, by_signal=False):
    """Steps with one reduction each; ``requester`` asks at step ``request_at``. Returns the stop step."""
    x = np.ones(3, dtype=np.float32)
    for step in range(STEPS):
        if step == request_at and strategy.rank == requester:
            if by_signal:
                os.kill(os.getpid(), signal.SIGUSR1)
            else:
                strategy.request_stop()
        total = strategy.reduce("sum", x)
        assert total[0] == strategy.num_replicas_in_sync
        if strategy.should_stop(check_every=check_every):
            return step
    return None


def _all_steps(strategy, step):
    return strategy.comm.allgather(step)


@pytest.mark.mpi
@pytest.mark.parametrize("requester", ["first", "last"])
def test_stop_seen_by_every_rank_at_the_same_step(requester):
    strategy = md.MPIStrategy(device="cpu")
    try:
        for _ in range(2):  # twice: a fresh strategy each time starts unstopped
            fresh = md.MPIStrategy(device="cpu")
            who = 0 if requester == "first" else fresh.num_replicas_in_sync - 1
            stopped = _loop(fresh, request_at=3, requester=who)
            steps = _all_steps(fresh, stopped)
            assert steps == [3] * fresh.num_replicas_in_sync
            assert fresh.should_stop()  # stays True
            fresh.free()
    finally:
        strategy.free()


@pytest.mark.mpi
def test_stop_with_checks_off_is_seen_within_check_every_calls():
    strategy = md.MPIStrategy(device="cpu", check_collectives=False, timeout=None, check_finite=False)
    try:
        n = strategy.num_replicas_in_sync
        stopped = _loop(strategy, request_at=5, requester=n - 1, check_every=4)
        # calls 4, 8, 12, ... check (steps 3, 7, 11, ...): the request at step 5 is seen at step 7;
        # a one-rank world needs nobody's agreement and stops at once
        expected = 5 if n == 1 else 7
        assert _all_steps(strategy, stopped) == [expected] * n
    finally:
        strategy.free()


@pytest.mark.mpi
def test_signal_on_one_rank_stops_every_rank_at_the_same_step():
    strategy = md.MPIStrategy(device="cpu")
    previous = strategy.stop_on_signals(signal.SIGUSR1)
    try:
        n = strategy.num_replicas_in_sync
        stopped = _loop(strategy, request_at=2, requester=n - 1, by_signal=True)
        assert _all_steps(strategy, stopped) == [2] * n
        got = strategy.comm.allgather(strategy.stop_signal)
        assert got == [None] * (n - 1) + [int(signal.SIGUSR1)]
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        strategy.free()


@pytest.mark.mpi
def test_checkpoint_after_agreed_stop_restores_the_same_step(tmp_path_factory):
    strategy = md.MPIStrategy(device="cpu")
    directory = strategy.comm.bcast(str(tmp_path_factory.mktemp("stop")) if strategy.rank == 0 else None)
    try:
        with strategy.scope():
            w = md.Variable(np.zeros(4, np.float32), name="w", aggregation=md.VariableAggregation.MEAN)
        step_done = np.zeros((), np.int64)
        checkpoint = md.Checkpoint(w=w, step=step_done)
        for step in range(STEPS):
            if step == 4 and strategy.rank == strategy.num_replicas_in_sync - 1:
                strategy.request_stop()
            strategy.run(lambda: w.assign_add(np.full(4, float(strategy.rank), np.float32)))
            step_done[...] = step + 1
            if strategy.should_stop():
                checkpoint.save(directory)
                break
        restored = md.read_checkpoint(directory)
        n = strategy.num_replicas_in_sync
        assert int(restored["step"]) == 5
        np.testing.assert_allclose(restored["w"], np.full(4, 5 * (n - 1) / 2, np.float32))
    finally:
        strategy.free()


def test_signal_names():
    assert signal_numbers(("USR1", "sigterm", signal.SIGUSR2, 1)) == (
        int(signal.SIGUSR1), int(signal.SIGTERM), int(signal.SIGUSR2), 1)
    with pytest.raises(ValueError, match="unknown signal"):
        signal_numbers(("NOPE",))
    with pytest.raises(TypeError):
        signal_numbers((1.5,))


def test_one_rank_stops_at_the_next_check():
    strategy = md.MPIStrategy(device="cpu")
    try:
        if strategy.num_replicas_in_sync != 1:
            pytest.skip("one-rank world only")
        assert not strategy.should_stop()
        strategy.request_stop()
        assert strategy.should_stop() and strategy.should_stop()
    finally:
        strategy.free()


# -- the job script on a real Slurm -----------------------------------------------------------
EPOCHS = 150  # long enough (several seconds) to be signalled while it trains
WAIT = 180  # seconds for each phase of a job


def _submit(cluster, workdir, launcher, name, ckpt):
    env = dict(cluster.env, MPIDIST_VENV=sys.prefix, MPIDIST_LAUNCHER=launcher, MPIDIST_DEVICE="cpu",
               PYTHONDONTWRITEBYTECODE="1")
    for key in ("MPIDIST_SRUN_MPI", "MPIDIST_MPIEXEC", "MPIDIST_JOBS"):
        env.pop(key, None)
    command = ["sbatch", "--parsable", f"--job-name=mpidist-test-{name}", "--time=5",
               f"--output={workdir}/{name}-%j.out", "--nodes=1", f"--ntasks-per-node={TASKS}", "--cpus-per-task=1",
               *cluster.sbatch_args, JOBS / "train.sbatch", "--epochs", str(EPOCHS), "--checkpoint-dir", ckpt,
               "--progress", "lines", "--data", "shipped"]
    result = _run(command, 60, env=env, cwd=REPO)
    assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
    return result.stdout.strip().split(";")[0]


def _output(workdir, name):
    files = sorted(workdir.glob(f"{name}-*.out"))
    return files[0].read_text(errors="replace") if files else ""


def _until(what, check, timeout=WAIT):
    """Poll ``check()`` every 0.2 s until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _final(cluster, job_id, workdir, name):
    def ended():
        fields = _scontrol_jobs(cluster.env).get(job_id)
        if fields is None:
            return {"JobState": "VANISHED"}
        return fields if fields.get("JobState") in FINAL_STATES else None

    return _until(f"job {job_id} to end\n{_output(workdir, name)}", ended)


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_signalled_job_saves_requeues_and_resumes_to_the_same_result(cluster, launcher, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"preempt-{launcher}")
    os.chmod(workdir, 0o755)
    name = f"preempt-{launcher}"
    job_id = _submit(cluster, workdir, launcher, name, workdir / "ckpt")
    try:
        def third_epoch():
            out = _output(workdir, name)
            return "did not start" if MPICH_START_FAILURE.search(out) else re.search(rf"^epoch 3/{EPOCHS}:", out, re.M)

        if _until("the job to train its third epoch", third_epoch) == "did not start":
            xfail_if_mpich_failed_to_start(_output(workdir, name), launcher)
        signalled = _run(["scancel", "--signal=USR1", "--batch", job_id], 30, env=cluster.env)
        assert signalled.returncode == 0, signalled.stderr

        def requeued():
            fields = _scontrol_jobs(cluster.env).get(job_id, {})
            assert fields.get("JobState") not in FINAL_STATES, f"{fields}\n{_output(workdir, name)}"
            # released only once Slurm set its start time (Reason=BeginTime): the old run has ended
            return (fields.get("JobState") == "PENDING" and int(fields.get("Restarts", "0")) >= 1
                    and fields.get("Reason") not in (None, "None"))

        _until("the job to requeue itself", requeued)
        released = _run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], 30, env=cluster.env)
        assert released.returncode == 0, released.stderr
        final = _final(cluster, job_id, workdir, name)
    finally:
        _run(["scancel", job_id], 30, env=cluster.env)  # a no-op once it ended
    output = _output(workdir, name)
    report = f"job {job_id} via {launcher}: {final.get('JobState')} {final.get('ExitCode')}\n{output[-6000:]}"
    assert final.get("JobState") == "COMPLETED" and final.get("ExitCode") == "0:0", report
    stop = re.search(rf"stop requested: every rank stopped in epoch (\d+)/{EPOCHS} after step (\d+)/\d+, saved", output)
    assert stop, report
    epoch, step = int(stop.group(1)), int(stop.group(2))
    assert "requeueing job" in output, report
    assert re.search(rf"resumed from \S+ after epoch {epoch - 1} and step {step} of epoch {epoch}$", output, re.M), report
    assert re.search(rf"^epoch {EPOCHS}/{EPOCHS}:", output, re.M), report
    resumed = re.search(r"final held-out accuracy: (\d+\.\d+)%", output)
    assert resumed, report

    # the same job, never stopped: the same final weights, bit for bit
    reference = f"reference-{launcher}"
    ref_id = _submit(cluster, workdir, launcher, reference, workdir / "ckpt-reference")
    try:
        ref_final = _final(cluster, ref_id, workdir, reference)
    finally:
        _run(["scancel", ref_id], 30, env=cluster.env)
    ref_output = _output(workdir, reference)
    assert ref_final.get("JobState") == "COMPLETED", ref_output[-6000:]
    assert "stop requested" not in ref_output
    assert re.search(r"final held-out accuracy: (\d+\.\d+)%", ref_output).group(1) == resumed.group(1)
    got, expected = md.read_checkpoint(workdir / "ckpt"), md.read_checkpoint(workdir / "ckpt-reference")
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert int(got["epochs_done"]) == EPOCHS
