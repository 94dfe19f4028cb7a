"""The job scripts in ``jobs/``, submitted with ``sbatch`` to a real Slurm and checked by final state.

Marked ``slurm``: CTest runs these once per MPI (``python3 tests/run.py``), with that MPI's
virtual environment. The cluster:

- when ``CI`` is set, or no ``sbatch`` is installed, or no Slurm controller answers: a one-node
  cluster of this machine's own, brought up by ``tests/system/cluster/slurm-up.sh`` (as root; it
  installs Debian's Slurm packages when missing) and always torn down by
  ``tests/system/cluster/slurm-down.sh``, also when a test fails, and by the script's watchdog should
  this process be killed;
- otherwise the Slurm that ``sbatch`` reaches (extra ``sbatch`` options, such as
  ``--partition`` or ``--account``, come from ``MPIDIST_TEST_SBATCH_ARGS``).

Not root and no Slurm: skipped, with the reason, unless the system tests were asked for
(``MPIDIST_TEST_SYSTEM=1``, which ``tests/run.py --system`` and ``CI=true`` set): then it fails.
The jobs are submitted from the repository root, as a user would (the scripts read
``jobs/launch.sh`` from there), and run in CPU mode (``MPIDIST_DEVICE=cpu``) on 2 tasks of 1
core each; the own cluster declares 2 stand-in GPUs so that the scripts' ``--gpus-per-task=1``
is granted as written. Every script runs under ``mpiexec`` and under
``srun`` with the MPI's plugin (``--mpi=pmix`` for Open MPI, ``--mpi=pmi2`` for MPICH), and a
wrong plugin must fail the job (N one-rank worlds instead of one N-rank world). All jobs are
submitted at once and followed with ``scontrol`` until each reaches a final state; every wait
has a timeout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paths import CLUSTER, JOBS, REPO

pytestmark = pytest.mark.slurm

UP_TIMEOUT = 900  # seconds; includes installing the Slurm packages with apt-get
DOWN_TIMEOUT = 60
JOBS_TIMEOUT = 300  # all jobs together
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
TASKS = 2


def _run(args, timeout, env=None, cwd=None):
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def slurm_down(state: Path, env) -> None:
    """Stop the test cluster of ``state`` with ``slurm-down.sh``: it must exit 0 and leave none of its daemons."""
    daemons = {}
    for f in [*state.glob("slurmd*.pid"), state / "slurmctld.pid", state / "munge" / "munged.pid"]:
        text = f.read_text().strip() if f.is_file() else ""
        if text.isdigit():
            daemons[f.name] = int(text)
    start = time.monotonic()
    down = _run(["bash", CLUSTER / "slurm-down.sh", state], DOWN_TIMEOUT, env=env)
    print(f"test cluster down in {time.monotonic() - start:.1f} s")
    assert down.returncode == 0, f"slurm-down.sh exited {down.returncode}:\n{down.stdout}\n{down.stderr}"
    left = {name: pid for name, pid in daemons.items() if _running(pid)}
    assert not left, f"slurm-down.sh left {left} running:\n{down.stderr}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _mpi_flavour() -> str:
    """``"openmpi"`` or ``"mpich"``: the library this environment's mpi4py loads."""
    from mpi4py import MPI

    return "openmpi" if "open mpi" in MPI.Get_library_version().lower() else "mpich"


def _existing_slurm_answers(env) -> bool:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        return "is UP" in _run(["scontrol", "ping"], 10, env=env).stdout
    except subprocess.TimeoutExpired:
        return False


@dataclasses.dataclass
class Cluster:
    env: dict
    own: bool
    sbatch_args: list


@pytest.fixture(scope="module")
def cluster():
    env = dict(os.environ)
    if not os.environ.get("CI") and _existing_slurm_answers(env):
        yield Cluster(
            env,
            own=False,
            sbatch_args=["--gpus-per-task=0", *shlex.split(os.environ.get("MPIDIST_TEST_SBATCH_ARGS", ""))],
        )
        return
    if os.geteuid() != 0:
        asked = os.environ.get("MPIDIST_TEST_SYSTEM") == "1"  # then a missing cluster is a failure
        (pytest.fail if asked else pytest.skip)(
            "no Slurm answers here and bringing up a test cluster needs "
            "root (run as root, or on a machine with Slurm: see "
            "tests/system/cluster/slurm-up.sh)"
        )
    env["MPIDIST_SLURM_OWNER_PID"] = str(os.getpid())  # its watchdog tears down if we are killed
    env["MPIDIST_SLURM_GPUS"] = str(TASKS)
    start = time.monotonic()
    up = _run(["bash", CLUSTER / "slurm-up.sh"], UP_TIMEOUT, env=env)
    match = re.search(r"^export SLURM_CONF=(.+)$", up.stdout, re.M)
    if up.returncode != 0 or not match:
        pytest.fail(f"slurm-up.sh exited {up.returncode}:\n{up.stdout}\n{up.stderr}")
    conf = match.group(1).strip()
    print(f"test cluster up in {time.monotonic() - start:.1f} s ({conf})")
    env = dict(os.environ, SLURM_CONF=conf)
    try:
        yield Cluster(env, own=True, sbatch_args=[])
    finally:
        slurm_down(Path(conf).parent, env)


@dataclasses.dataclass
class Job:
    """One submission: what to submit and what its end must look like."""

    name: str
    script: str
    launcher: str  # "srun" or "mpiexec"
    args: list = dataclasses.field(default_factory=list)
    env: dict = dataclasses.field(default_factory=dict)
    after: str = ""  # name of a job this one waits for (afterok)
    state: str = "COMPLETED"
    expect: list = dataclasses.field(default_factory=list)  # regexes the output must match
    files: list = dataclasses.field(default_factory=list)  # files it must write, relative to the work folder
    job_id: str = ""
    final: dict = dataclasses.field(default_factory=dict)
    output: str = ""


def _jobs(flavour: str, workdir: Path) -> list[Job]:
    plugin = "pmix" if flavour == "openmpi" else "pmi2"
    wrong = "pmi2" if flavour == "openmpi" else "none"
    seen = {
        "srun": rf"launcher\s+srun --mpi={plugin}",
        "mpiexec": r"launcher\s+mpiexec \(" + ("Open MPI" if flavour == "openmpi" else "MPICH") + r"\b",
    }
    world = rf"mpidist doctor: {TASKS} ranks on 1 node"
    ckpt = ["--checkpoint-dir", str(workdir / "ckpt")]
    quick_tests = [str(REPO / "tests" / "parallel" / "test_strategy.py"), "-k", "reduce"]

    def bench(launcher):  # the smallest run of `python -m mpidist bench`: a few small allreduces
        return [
            "--cases",
            "sweep",
            "--max-bytes",
            "4096",
            "--repeats",
            "3",
            "--no-torch",
            "--out",
            str(workdir / f"bench-{launcher}"),
        ]

    jobs = [
        # Train one epoch under mpiexec, then resume under srun for a second: same checkpoint.
        Job(
            "train-mpiexec",
            "train.sbatch",
            "mpiexec",
            ["--epochs", "1", *ckpt],
            expect=[world, seen["mpiexec"], r"epoch 1/1\b", r"final held-out accuracy: \d+\.\d+%"],
        ),
        Job(
            "train-srun",
            "train.sbatch",
            "srun",
            ["--epochs", "2", *ckpt],
            after="train-mpiexec",
            expect=[
                world,
                seen["srun"],
                r"resum\w+ from .*epoch 1",
                r"epoch 2/2\b",
                r"final held-out accuracy: \d+\.\d+%",
            ],
        ),
        Job(
            "benchmark-srun",
            "benchmark.sbatch",
            "srun",
            bench("srun"),
            expect=[world, seen["srun"]],
            files=["bench-srun/results.json"],
        ),
        Job(
            "benchmark-mpiexec",
            "benchmark.sbatch",
            "mpiexec",
            bench("mpiexec"),
            expect=[world, seen["mpiexec"]],
            files=["bench-mpiexec/results.json"],
        ),
        Job("tests-srun", "tests.sbatch", "srun", quick_tests, expect=[world, seen["srun"], r"\d+ passed"]),
        Job("tests-mpiexec", "tests.sbatch", "mpiexec", quick_tests, expect=[world, seen["mpiexec"], r"\d+ passed"]),
        # A wrong srun plugin gives N one-rank worlds: the script must fail loudly, not train N times.
        Job(
            "wrong-srun-plugin",
            "tests.sbatch",
            "srun",
            quick_tests,
            env={"MPIDIST_SRUN_MPI": wrong},
            state="FAILED",
            expect=[r"the MPI world has 1 rank, but 2 were expected", r"did not start one MPI world of 2 ranks"],
        ),
    ]
    return jobs


def _sbatch_options(job: Job) -> list[str]:
    if job.script == "tests.sbatch":
        return [f"--ntasks={TASKS}", "--cpus-per-task=1"]
    return ["--nodes=1", f"--ntasks-per-node={TASKS}", "--cpus-per-task=1"]


def _scontrol_jobs(env) -> dict[str, dict[str, str]]:
    """``{job id: {field: value}}`` of every job the controller still knows."""
    out = _run(["scontrol", "-o", "show", "job"], 30, env=env).stdout
    jobs = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in fields:
            jobs[fields["JobId"]] = fields
    return jobs


@pytest.fixture(scope="module")
def finished(cluster, tmp_path_factory):
    """Submit every job at once, wait until each has reached a final state; ``{name: Job}``."""
    workdir = tmp_path_factory.mktemp("slurm-jobs")
    os.chmod(workdir, 0o755)
    jobs = _jobs(_mpi_flavour(), workdir)
    by_name = {job.name: job for job in jobs}
    start = time.monotonic()
    try:
        for job in jobs:
            env = dict(
                cluster.env,
                MPIDIST_VENV=sys.prefix,
                MPIDIST_LAUNCHER=job.launcher,
                MPIDIST_DEVICE="cpu",
                PYTHONDONTWRITEBYTECODE="1",
                **job.env,
            )
            for name in ("MPIDIST_SRUN_MPI", "MPIDIST_MPIEXEC", "MPIDIST_JOBS"):
                if name not in job.env:
                    env.pop(name, None)  # the scripts pick the plugin and find mpiexec and launch.sh
            dependency = (
                [f"--dependency=afterok:{by_name[job.after].job_id}", "--kill-on-invalid-dep=yes"] if job.after else []
            )
            command = [
                "sbatch",
                "--parsable",
                f"--job-name=mpidist-test-{job.name}",
                "--time=5",
                f"--output={workdir}/{job.name}-%j.out",
                *_sbatch_options(job),
                *cluster.sbatch_args,
                *dependency,
                JOBS / job.script,
                *job.args,
            ]
            result = _run(command, 60, env=env, cwd=REPO)
            assert result.returncode == 0, f"{shlex.join(map(str, command))}\n{result.stdout}{result.stderr}"
            job.job_id = result.stdout.strip().split(";")[0]
        pending = {job.job_id: job for job in jobs}
        while pending and time.monotonic() - start < JOBS_TIMEOUT:
            known = _scontrol_jobs(cluster.env)
            for job_id, job in list(pending.items()):
                fields = known.get(job_id)
                if fields is None:
                    job.final = {"JobState": "VANISHED (no final state seen)"}
                elif fields.get("JobState") in FINAL_STATES:
                    job.final = fields
                else:
                    continue
                del pending[job_id]
            time.sleep(0.3)
        for job in pending.values():
            job.final = {"JobState": f"NOT FINISHED after {JOBS_TIMEOUT} s"}
    finally:
        ids = [job.job_id for job in jobs if job.job_id and not job.final]
        if ids:
            _run(["scancel", *ids], 30, env=cluster.env)
    for job in jobs:
        outputs = sorted(workdir.glob(f"{job.name}-*.out"))
        job.output = outputs[0].read_text(errors="replace") if outputs else "(no output file)"
    print(f"{len(jobs)} jobs finished in {time.monotonic() - start:.1f} s")
    return Finished(by_name, workdir)


class Finished(dict):
    """``{job name: Job}`` after every job ended, and the folder the jobs ran in."""

    def __init__(self, jobs: dict, workdir: Path) -> None:
        super().__init__(jobs)
        self.workdir = workdir


JOB_NAMES = [job.name for job in _jobs("openmpi", Path("."))]
# The pip MPICH (5.0, over UCX) now and then failed inside MPI_Init under srun on this one-node
# test cluster ("invalid bandwidth", "Message truncated"), before any mpidist code runs. One cause
# is known and removed: a step joined the shared-memory segment a killed step of an earlier job of
# the same id had left (test clusters now take job ids of their own, and jobs/launch.sh removes a
# requeued job's stale segments; tests/system/test_preemption_slurm.py checks the latter). Until
# runs show no other cause, that failure of MPI_Init stays an expected failure here.
MPICH_START_FAILURE = re.compile(r"Fatal error in internal_Init_thread|UCX +ERROR failed to unpack address")


def xfail_if_mpich_failed_to_start(output: str, launcher: str) -> None:
    """Report the known MPICH start-up failure under srun as an expected failure (any other stays a failure)."""
    if launcher == "srun" and _mpi_flavour() == "mpich" and MPICH_START_FAILURE.search(output):
        pytest.xfail("the pip MPICH failed inside MPI_Init under srun (UCX start-up) on the one-node test cluster")


@pytest.mark.parametrize("name", JOB_NAMES)
def test_job_final_state_and_output(finished, name):
    job = finished[name]
    report = (
        f"job {job.name} ({job.script} via {job.launcher}, id {job.job_id}): "
        f"JobState={job.final.get('JobState')} ExitCode={job.final.get('ExitCode')}\n"
        f"--- output ---\n{job.output[-6000:]}"
    )
    if job.final.get("JobState") != job.state:
        xfail_if_mpich_failed_to_start(job.output, job.launcher)
    assert job.final.get("JobState") == job.state, report
    if job.state == "COMPLETED":
        assert job.final.get("ExitCode") == "0:0", report
    for pattern in job.expect:
        assert re.search(pattern, job.output), f"output lacks /{pattern}/\n{report}"
    for name in job.files:
        assert (finished.workdir / name).is_file(), f"{name} was not written\n{report}"
