"""How a whole MPI job ends, with a real ``mpiexec``: a failure on any rank fails the job.

The jobs run pytest files from ``tests/helpers/samples/``, which normal runs do not collect (the
names do not match ``test_*.py`` and ``setup.cfg`` lists ``helpers`` in ``norecursedirs``);
some of them fail on purpose. These tests are serial: each starts its own ``mpiexec``.
"""

import os
import sys
import uuid
from pathlib import Path

import pytest

import mpirun
from mpirun import mpi_env, mpiexec_command, run_mpi
from paths import SAMPLES

TIMEOUT = 60  # seconds; each job below takes 1 to 3


def sample_argv(sample, *, abort_on_error=True):
    """argv that runs one sample file with pytest on every rank."""
    launcher = [sys.executable, "-m", "mpi4py"] if abort_on_error else [sys.executable]
    return [*launcher, "-m", "pytest", "--with-mpi", "-q", str(SAMPLES / sample)]


def test_failure_on_one_rank_fails_the_job():
    result = run_mpi(2, sample_argv("sample_fail_on_rank1.py"), timeout=TIMEOUT)
    assert result.returncode not in (0, None), result.describe()
    assert "deliberate failure on rank 1" in result.stdout + result.stderr, result.describe()


def test_exception_before_a_collective_aborts_the_job():
    result = run_mpi(2, sample_argv("sample_raise_before_barrier.py"), timeout=TIMEOUT)
    # Not a timeout: `-m mpi4py` turns rank 1's failure into MPI_Abort; rank 0 stops waiting.
    assert result.returncode not in (0, None), result.describe()
    assert result.elapsed < TIMEOUT / 2, result.describe()


def test_passing_job_exits_zero_at_three_ranks():
    result = run_mpi(3, sample_argv("sample_pass.py"), timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    assert result.stdout.count("1 passed") == 3, result.describe()  # one summary per rank


def _processes_with_token(token):
    """pids whose environment holds ``token`` (Linux /proc; empty elsewhere)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_hung_job_is_killed_at_the_timeout():
    # Without `-m mpi4py`, rank 0 waits in the barrier forever: run_mpi must end the job.
    token = f"MPIDIST_TEST_TOKEN_{uuid.uuid4().hex}"
    env = {**os.environ, token: "1"}
    argv = sample_argv("sample_raise_before_barrier.py", abort_on_error=False)
    result = run_mpi(2, argv, timeout=4, env=env)
    assert result.returncode is None, result.describe()
    assert result.elapsed < 4 + 15, result.describe()
    assert _processes_with_token(token) == [], "processes of the killed job are still running"


def test_mpiexec_command(monkeypatch):
    monkeypatch.delenv("MPIDIST_MPIEXEC", raising=False)
    monkeypatch.delenv("MPIDIST_MPIEXEC_NUMPROC_FLAG", raising=False)
    monkeypatch.delenv("MPIDIST_MPIEXEC_PREFLAGS", raising=False)
    command = mpiexec_command(3, ["prog", "arg"])
    assert command[1:] == ["-n", "3", "prog", "arg"]
    assert Path(command[0]).name in ("mpiexec", "mpirun")

    monkeypatch.setenv("MPIDIST_MPIEXEC", "srun --mpi=pmix")
    monkeypatch.setenv("MPIDIST_MPIEXEC_NUMPROC_FLAG", "--ntasks")
    assert mpiexec_command(2, ["prog"]) == ["srun", "--mpi=pmix", "--ntasks", "2", "prog"]


def test_mpi_env_adds_the_env_file_of_the_launchers_mpi(monkeypatch):
    monkeypatch.setattr(mpirun, "mpi_flavour", lambda launcher: "openmpi")
    env = mpi_env({"OMPI_MCA_btl": "self,vader"})
    assert env["OMPI_MCA_btl"] == "self,vader"  # the caller's value wins
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    monkeypatch.setattr(mpirun, "mpi_flavour", lambda launcher: None)  # srun, or an unknown launcher
    assert mpi_env({"A": "1"}) == {"A": "1"}


def test_mpi_flavour_of_this_environments_mpiexec():
    launcher = mpirun.find_mpiexec()[0]
    if Path(launcher).name not in ("mpiexec", "mpirun"):
        pytest.skip(f"the launcher is {launcher}, not an MPI library's mpiexec")
    assert mpirun.mpi_flavour(launcher) in ("openmpi", "mpich"), launcher
