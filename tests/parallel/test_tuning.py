"""Open MPI's nonblocking allreduce algorithm, whatever the order of the imports, on whole jobs.

Each test launches ``tests/helpers/samples/tuning_job.py`` as its own MPI job under a timeout
(plain ``mpiexec -n N python script.py``, no ``-m mpi4py``), and reads back through MPI_T what
every rank has. Below 4 ranks under Open MPI mpidist chooses the ring (1): in the environment
when mpidist is imported before ``mpi4py.MPI``, through MPI_T when mpi4py came first; at 4 ranks,
or when the user chose, the control variable keeps its value; MPICH is left alone.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from mpidist._comm.library import library_version
from mpirun import run_mpi
from paths import SAMPLES

JOB = str(SAMPLES / "tuning_job.py")
VAR = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
OPEN_MPI = library_version().startswith("Open MPI")


def launch(n, order, out_dir, chosen=None):
    """Run the job at ``n`` ranks; the ranks' reports, checked to be one per rank and alike."""
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if chosen is not None:
        env[VAR] = chosen
    result = run_mpi(n, [sys.executable, JOB, order, str(out_dir)], timeout=60, env=env)
    assert result.returncode == 0, result.describe()
    seen = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(n)]
    assert all(s == seen[0] for s in seen), (seen, result.describe())  # every rank alike
    assert seen[0]["world"] == n and seen[0]["sum_ok"], seen[0]
    return seen[0]


def expect(report, how, before, after):
    got = {k: report[k] for k in ("how", "before", "after")}
    if OPEN_MPI:
        assert got == {"how": how, "before": before, "after": after}, report
    else:  # no such variable: never touched, never asked
        assert got == {"how": "not applicable", "before": None, "after": None}, report


@pytest.mark.parametrize("n", [2, 3])
def test_the_ring_is_set_through_mpi_t_when_mpi4py_is_imported_first(n, tmp_path):
    expect(launch(n, "mpi4py-first", tmp_path), "MPI_T", 0, 1)


def test_the_ring_is_set_in_the_environment_when_mpidist_is_imported_first(tmp_path):
    expect(launch(2, "mpidist-first", tmp_path), "environment", 1, 1)


def test_open_mpis_own_choice_stays_at_four_ranks(tmp_path):
    expect(launch(4, "mpi4py-first", tmp_path), "not applicable", 0, 0)


@pytest.mark.parametrize("chosen", ["3", "0"])
def test_the_users_choice_stays(chosen, tmp_path):
    report = launch(2, "mpi4py-first", tmp_path, chosen=chosen)
    expect(report, "user", int(chosen), int(chosen))
    if OPEN_MPI:
        assert f"{VAR}={chosen}" in report["detail"]
