"""Start MPI jobs from tests and scripts: ``mpiexec`` as a subprocess, always under a timeout.

For tests that check what happens to a whole job (a failure on one rank, an exception
before a collective, a hang), and for ``tests/run.py``. Standard library only.

    from mpirun import run_mpi

    result = run_mpi(2, [sys.executable, "-m", "mpi4py", "script.py"], timeout=60)
    assert result.returncode not in (0, None), result.describe()

The launcher is :func:`find_mpiexec`'s (``MPIDIST_MPIEXEC``, e.g. ``"srun --mpi=pmix"`` on a
cluster, else the ``mpiexec`` next to ``sys.executable``, else ``PATH``'s), with
``MPIDIST_MPIEXEC_NUMPROC_FLAG`` (default ``-n``) and ``MPIDIST_MPIEXEC_PREFLAGS`` (flags after
the process count), and the environment of ``jobs/env.<MPI>`` (:func:`mpi_env`). The launcher's
whole process tree is killed when the timeout expires; then ``returncode`` is ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from paths import JOBS

__all__ = [
    "MPIResult",
    "find_mpiexec",
    "mpi_env",
    "mpi_flavour",
    "mpiexec_command",
    "read_env_file",
    "run_command",
    "run_mpi",
]

# Seconds between SIGTERM (the launcher forwards it to the ranks and cleans up) and SIGKILL.
KILL_GRACE = 3.0


def find_mpiexec(python: str | None = None) -> list[str]:
    """The launcher as a command prefix: ``MPIDIST_MPIEXEC`` (a path, or a command line), else
    the ``mpiexec`` in the directory of ``python`` (default ``sys.executable``, not resolved: a
    virtual environment's ``bin``), else the first ``mpiexec`` or ``mpirun`` on ``PATH``."""
    override = os.environ.get("MPIDIST_MPIEXEC", "").strip()
    if override:  # the path of the launcher itself may hold spaces
        return [override] if os.path.isfile(override) else shlex.split(override)
    beside = Path(python or sys.executable).parent / "mpiexec"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError(
            f"no mpiexec next to {python or sys.executable} or on PATH; install an MPI "
            "(pip install -e '.[test,mpi]' or '.[test,mpich]') or set MPIDIST_MPIEXEC"
        )
    return [found]


@functools.cache
def mpi_flavour(launcher: str) -> str | None:
    """``"openmpi"``, ``"mpich"`` or ``None`` (srun, unknown): the MPI of ``launcher --version``."""
    try:
        out = subprocess.run(
            [launcher, "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "openmpi" if re.search("Open MPI|OpenRTE|PRRTE", out) else "mpich" if re.search("HYDRA|MPICH", out) else None


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """The ``NAME=value`` lines of an env file such as ``jobs/env.openmpi`` (comments skipped)."""
    lines = Path(path).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if re.match(r"[A-Za-z_]\w*=", line))


def mpi_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with ``jobs/env.<MPI>`` of the launcher added;
    variables already in ``env`` keep their values."""
    result = dict(os.environ if env is None else env)
    flavour = mpi_flavour(find_mpiexec()[0])
    if flavour:
        for key, value in read_env_file(JOBS / f"env.{flavour}").items():
            result.setdefault(key, value)
    return result


def mpiexec_command(n: int, argv: Sequence[str], python: str | None = None) -> list[str]:
    """The command line that runs ``argv`` on ``n`` processes (run it with :func:`mpi_env`)."""
    if n < 1:
        raise ValueError(f"number of processes must be at least 1, got {n}")
    if not argv:
        raise ValueError("argv is empty: nothing to run")
    numproc_flag = os.environ.get("MPIDIST_MPIEXEC_NUMPROC_FLAG", "").strip() or "-n"
    preflags = shlex.split(os.environ.get("MPIDIST_MPIEXEC_PREFLAGS", ""))
    return [*find_mpiexec(python), numproc_flag, str(n), *preflags, *map(str, argv)]


@dataclasses.dataclass
class MPIResult:
    """What :func:`run_command` and :func:`run_mpi` return (like ``CompletedProcess``)."""

    args: list[str]
    returncode: int | None  # None: killed when the timeout expired
    stdout: str
    stderr: str
    elapsed: float  # seconds

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self, tail: int = 3000) -> str:
        """A report for assertion messages: command, outcome and the end of the output."""
        outcome = "timed out" if self.timed_out else f"exited with {self.returncode}"
        return (
            f"{shlex.join(self.args)}\n{outcome} after {self.elapsed:.1f} s\n"
            f"--- stdout (end) ---\n{self.stdout[-tail:]}\n--- stderr (end) ---\n{self.stderr[-tail:]}"
        )


def _job_pids(leader: int) -> set[int]:
    """Descendants of ``leader`` and members of its session (orphaned ranks stay in it), from /proc."""
    children: dict[int, list[int]] = {}
    found = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read() if entry.isdigit() else b""
        except OSError:  # the process has gone
            continue
        if not stat:
            continue
        # After the command name (in parentheses, may hold anything): state, ppid, pgrp, session.
        fields = stat[stat.rfind(b")") + 2 :].split()
        pid, ppid, sid = int(entry), int(fields[1]), int(fields[3])
        children.setdefault(ppid, []).append(pid)
        if sid == leader and pid != leader:
            found.add(pid)
    todo = [leader, *found]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal_all(pgid: int, pids: set[int], sig: int) -> None:
    for kill, target in [(os.killpg, pgid), *((os.kill, pid) for pid in pids)]:
        try:
            kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_job(proc: subprocess.Popen) -> None:
    """Stop ``proc`` (leader of its own session), its process group and all its descendants."""
    pids = _job_pids(proc.pid)  # first: once the launcher dies, its orphans lose their ancestry
    _signal_all(proc.pid, pids, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE)
    except subprocess.TimeoutExpired:
        pass
    _signal_all(proc.pid, pids | _job_pids(proc.pid), signal.SIGKILL)
    proc.wait()


def run_command(
    args: Sequence[str],
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    capture: bool = True,
) -> MPIResult:
    """Run ``args`` in a new session and process group; kill all of it after ``timeout`` s.

    With ``capture=False`` the output goes to this process's stdout/stderr and the result
    holds empty strings. Standard input is ``/dev/null``. On timeout ``returncode`` is
    ``None``; an interrupt (Ctrl-C) kills the job too, then propagates. A launch that Open
    MPI's launcher gave up before starting any process (:data:`LAUNCHER_START_FAILURES`, seen
    about once in a full run of the suites) is made again, once.
    """
    result = _run_once(args, timeout, env, cwd, capture)
    if result.returncode not in (0, None) and any(m in result.stderr for m in LAUNCHER_START_FAILURES):
        result = _run_once(args, timeout, env, cwd, capture)
    return result


# What Open MPI's launcher says when it could not start its own machinery, before any process ran.
LAUNCHER_START_FAILURES = ("The PMIx server's listener thread failed to start",)


def _run_once(
    args: Sequence[str],
    timeout: float | None,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike | None,
    capture: bool,
) -> MPIResult:
    args = [str(a) for a in args]
    pipe = subprocess.PIPE if capture else None
    start = time.monotonic()
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=pipe,
        stderr=pipe,
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        returncode = None
        try:  # output written before the kill; a straggler holding the pipes must not block us
            stdout, stderr = proc.communicate(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(output lost: a process kept the pipes open)"
    except BaseException:  # KeyboardInterrupt and the like: leave nothing running, re-raise
        _kill_job(proc)
        raise
    finally:  # processes the job left behind (a rank that outlived its launcher)
        leftovers = _job_pids(proc.pid) if proc.returncode is not None else None
        if leftovers:
            _signal_all(proc.pid, leftovers, signal.SIGKILL)
    return MPIResult(args, returncode, stdout or "", stderr or "", time.monotonic() - start)


def run_mpi(
    n: int,
    argv: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> MPIResult:
    """Run ``argv`` on ``n`` MPI processes; never waits longer than ``timeout`` (plus the kill).

    ``env`` (default ``os.environ``) gets :func:`mpi_env`'s additions, and ``MPIEXEC_TIMEOUT``
    (honoured by Open MPI and MPICH) a little above ``timeout``, so that a launcher left
    behind by a killed caller still ends.
    """
    full_env = mpi_env(env)
    if env is None or "MPIEXEC_TIMEOUT" not in env:
        full_env["MPIEXEC_TIMEOUT"] = str(math.ceil(timeout) + 10)
    return run_command(mpiexec_command(n, argv), timeout, env=full_env, cwd=cwd)
