"""The scripts in ``jobs/`` that run without Slurm, and what every batch script must contain.

``tests/system/test_slurm.py`` submits the batch scripts to a real Slurm; here, serially: shell syntax,
the shared launch logic of ``jobs/launch.sh`` (the world-size check, the env files), the
one-rank-per-GPU layout of each batch script, and ``jobs/mpirun.sh`` under the MPI of this environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import read_env_file, run_command
from paths import CLUSTER, JOBS

BATCH = sorted(JOBS.glob("*.sbatch"))
TIMEOUT = 60


def _directives(script: Path) -> dict[str, str]:
    found = {}
    for line in script.read_text().splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            found[match.group(1)] = match.group(2) or ""
    return found


@pytest.mark.parametrize(
    "script", [*BATCH, JOBS / "mpirun.sh", JOBS / "launch.sh", *sorted(CLUSTER.glob("*.sh"))], ids=lambda p: p.name
)
def test_shell_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr


def test_the_batch_scripts_are_there():
    assert {p.name for p in BATCH} == {"train.sbatch", "benchmark.sbatch", "tests.sbatch"}


@pytest.mark.parametrize("script", BATCH, ids=lambda p: p.name)
def test_batch_script_uses_the_shared_launch_and_says_what_to_edit(script):
    text = script.read_text()
    assert 'source "${MPIDIST_JOBS:-${SLURM_SUBMIT_DIR:-.}/jobs}/launch.sh"\nslurm_launch' in text
    assert '"${launch[@]}" "$python" -m ' in text
    assert "EDIT" in text and "--account" in text and "--partition" in text
    assert "module load" in text and "activate" in text


def test_launch_checks_the_world_size():
    text = (JOBS / "launch.sh").read_text()
    assert 'doctor --expect-ranks "$ntasks"' in text  # fails loudly on N one-rank worlds
    assert "SLURM_NTASKS" in text and "exit 1" in text
    assert 'srun --mpi="${MPIDIST_SRUN_MPI:-$plugin}"' in text
    assert "SRUN_CPUS_PER_TASK" in text and 'OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK' in text


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_bash_and_python_read_the_env_file_alike(mpi):
    path = JOBS / f"env.{mpi}"
    expected = read_env_file(path)
    clean = {k: v for k, v in os.environ.items() if k not in expected}
    script = f"source {JOBS / 'launch.sh'}; load_mpi_env {mpi}; env -0"
    result = subprocess.run(["bash", "-c", script], env=clean, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    env = dict(item.split("=", 1) for item in result.stdout.split("\0") if "=" in item)
    assert {k: env.get(k) for k in expected} == expected
    if mpi == "openmpi":
        assert expected["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and expected["OMPI_MCA_btl"] == "^ofi"
        kept = subprocess.run(
            ["bash", "-c", script],
            env={**clean, "OMPI_MCA_btl": "tcp,self"},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        ).stdout
        assert "OMPI_MCA_btl=tcp,self\0" in kept  # a variable already set keeps its value


@pytest.mark.parametrize("name", ["train.sbatch", "benchmark.sbatch"])
def test_gpu_scripts_run_one_rank_per_gpu(name):
    directives = _directives(JOBS / name)
    assert directives["gpus-per-task"] == "1"
    assert "ntasks-per-node" in directives and "cpus-per-task" in directives


def test_mpirun_sh_help():
    result = subprocess.run(
        ["bash", str(JOBS / "mpirun.sh"), "--help"], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0 and "mpiexec" in result.stdout and "env.openmpi" in result.stdout


@pytest.mark.parametrize(
    "args, complaint",
    [
        ([], "no program to run"),
        (["-n", "2"], "no program to run"),  # said before: no mpiexec next to 'the program'
        (["-n", "0", sys.executable, "-c", "pass"], "-n needs a number of ranks above 0, got '0'"),
        (["-np", "two", sys.executable, "-c", "pass"], "-np needs a number of ranks above 0, got 'two'"),
        (["-n"], "-n needs a number of ranks above 0, got ''"),
    ],
)
def test_mpirun_sh_refuses_a_missing_program_or_a_bad_number_of_ranks(args, complaint):
    # Open MPI started as many ranks as cores for -n 0 or -n two, and the job ran with exit status 0.
    result = subprocess.run(["bash", str(JOBS / "mpirun.sh"), *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and complaint in result.stderr and result.stdout == "", result.stderr


def test_mpirun_sh_finds_the_mpiexec_next_to_python():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PRTE_", "MPIEXEC", "MPIDIST_MPIEXEC"))}
    env["PATH"] = "/usr/bin:/bin"  # no mpiexec on PATH: it must be found next to the interpreter
    result = run_command(
        ["bash", str(JOBS / "mpirun.sh"), "-n", "2", sys.executable, "-m", "mpidist", "doctor", "--expect-ranks", "2"],
        TIMEOUT,
        env=env,
    )
    assert result.returncode == 0, result.describe()
    assert "mpidist doctor: 2 ranks on 1 node" in result.stdout, result.describe()


@pytest.mark.parametrize(
    ("mpi", "setting", "flags", "finalize"),
    [
        ("openmpi", "1", "--with-ft ulfm", "1"),
        ("openmpi", "on", "--with-ft ulfm", "1"),
        ("openmpi", "0", "", ""),
        ("openmpi", "", "", ""),
        ("mpich", "1", "", ""),  # MPICH cannot carry on: no flags (its launcher ends the job)
    ],
)
def test_fault_tolerance_launch_flags(mpi, setting, flags, finalize):
    """MPIDIST_FAULT_TOLERANCE=1 adds --with-ft ulfm for Open MPI, and exports the ranks' finalize setting."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MPIDIST_FAULT_TOLERANCE", "OMPI_MCA_async_mpi_finalize")}
    script = (
        f"source {JOBS / 'launch.sh'}; fault_tolerance_setup {mpi}; "
        'echo "${ft_flags[*]}|${OMPI_MCA_async_mpi_finalize:-}"'
    )
    env = {**clean, "MPIDIST_FAULT_TOLERANCE": setting}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{flags}|{finalize}"


@pytest.mark.parametrize(
    ("mpi", "started", "finished", "launcher", "expected"),
    [
        ("openmpi", 2, 0, 0, 1),  # every rank killed, the launcher says 0: the script fails
        ("openmpi", 3, 2, 0, 0),  # survivors finished
        ("openmpi", 2, 0, 3, 3),  # the launcher's own failure is kept
        ("openmpi", 0, 0, 0, 0),  # a program that never made an mpidist communicator is not judged
        ("mpich", 0, 0, 0, 0),  # no fault-tolerant launch: nothing is checked
    ],
)
def test_fault_tolerance_verdict_fails_a_job_in_which_no_rank_finished(
    mpi, started, finished, launcher, expected, tmp_path
):
    """A fault-tolerant launch notes which ranks started mpidist and which finished; the launcher's 0 with ranks
    started and none finished becomes 1."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MPIDIST_", "OMPI_MCA_async"))}
    script = (
        f"source {JOBS / 'launch.sh'}; fault_tolerance_setup {mpi}; fault_tolerance_marks {tmp_path}; "
        f'for r in $(seq 1 {started}); do touch "$MPIDIST_FINISHED_DIR/started-rank$r"; done; '
        f'for r in $(seq 1 {finished}); do touch "$MPIDIST_FINISHED_DIR/finished-rank$r"; done; '
        f'dir="${{MPIDIST_FINISHED_DIR:-}}"; fault_tolerance_verdict {launcher}; '
        'echo "status=$status left=$([ -n "$dir" ] && [ -d "$dir" ] && echo yes || echo no)"'
    )
    env = {**clean, "MPIDIST_FAULT_TOLERANCE": "1"}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"status={expected} left=no", result.stdout
    assert ("no rank's program ended normally" in result.stderr) == (expected == 1 and launcher == 0), result.stderr
