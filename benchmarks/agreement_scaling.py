"""The agreement's cost against the number of ranks: the ``scaling`` case of ``python -m mpidist bench`` at each N.

    python benchmarks/agreement_scaling.py --ranks 2,4,8,16 --out scaling-results
    # options: --repeats 31 --python .venv/bin/python --timeout 900

For each N of ``--ranks`` it runs, through ``jobs/mpirun.sh`` (the launcher next to the Python, with the
settings of ``jobs/env.openmpi`` or ``jobs/env.mpich``, which let more ranks than cores run), ::

    OMPI_MCA_pml_monitoring_enable=1 mpiexec -n N python -m mpidist bench --cases scaling --no-torch \\
        --repeats R --out OUT/ranks-N

then writes ``OUT/scaling.md``, the tables of every N together, and prints them. The case counts, for an 8-byte
mirrored update, an in-place 1 MiB allreduce and a barrier, by mpidist and by raw mpi4py: the MPI calls made
per collective, and per rank the point-to-point messages and bytes the MPI library sent for them, its
collective algorithms' own messages included. Counts do not depend on timing, so they hold with more ranks
than cores. Open MPI counts the messages with its monitoring component, which the variable above turns on
(a setting the launcher must give: MPI reads it when it starts); MPICH offers no such counters, and the
tables then show mpidist's calls alone. Where the ranks have a core each, the case also times the same
calls against raw mpi4py (``--repeats`` samples, interleaved); with more ranks than cores it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from mpidist._tools.bench_counts import ENABLE_MONITORING
from mpidist._tools.bench_report import scaling_tables

REPO = Path(__file__).resolve().parent.parent
MPIRUN = REPO / "jobs" / "mpirun.sh"


def bench_command(ranks: int, python: str, repeats: int, out: Path) -> list[str]:
    """The launch of the ``scaling`` case at ``ranks`` ranks, results into ``out``."""
    return [
        "bash",
        str(MPIRUN),
        "-n",
        str(ranks),
        python,
        "-m",
        "mpidist",
        "bench",
        "--cases",
        "scaling",
        "--no-torch",
        "--repeats",
        str(repeats),
        "--out",
        str(out),
    ]


def run(ranks: Sequence[int], python: str, repeats: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    """Run the case at each number of ``ranks``; returns each run's ``results.json``. Raises on a failed run."""
    env = dict(os.environ)
    env.setdefault(ENABLE_MONITORING, "1")  # harmless where the MPI is not Open MPI
    env.setdefault("MPIEXEC_TIMEOUT", str(int(timeout)))  # both launchers end the job after it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    runs = []
    for n in ranks:
        folder = out / f"ranks-{n}"
        command = bench_command(n, python, repeats, folder)
        print(f"[scaling] {' '.join(command)}", flush=True)
        subprocess.run(command, env=env, check=True, timeout=timeout + 30)
        runs.append(json.loads((folder / "results.json").read_text()))
    return runs


def write_tables(runs: Sequence[dict[str, Any]], out: Path) -> str:
    """Write ``out/scaling.md``, the tables of every run, and return its text."""
    text = "\n".join(scaling_tables([(r["meta"], r["results"]) for r in runs])).lstrip("\n") + "\n"
    (out / "scaling.md").write_text(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0]
        + "\nIt runs mpiexec itself, once per number of ranks: start it as a plain program.",
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", default="2,4,8,16", help="comma-separated numbers of ranks (default 2,4,8,16)")
    parser.add_argument("--out", default="scaling-results", help="folder for ranks-N/ and scaling.md")
    parser.add_argument("--repeats", type=int, default=7, help="timed samples per collective where timed (median)")
    parser.add_argument(
        "--python", default=sys.executable, help="the Python the ranks run; its folder's mpiexec launches them"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = [int(n) for n in args.ranks.split(",")]
    print(write_tables(run(ranks, args.python, args.repeats, out, args.timeout), out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
