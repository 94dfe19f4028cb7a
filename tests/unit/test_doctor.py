"""``python -m mpidist doctor``: the report, its warnings, and the node-local rank it relies on.

Serial tests: :func:`diagnose` and :func:`format_report` on made-up reports; the doctor itself
under a real ``mpiexec`` (``tests/helpers/mpirun.py``), at 3 ranks and with a wrong ``--expect-ranks``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpidist._comm import topology as _topology
from mpidist._tools import doctor as _doctor
from mpirun import run_mpi

TIMEOUT = 60


def _rank(rank, host="n1", local=0, size=2, cores=(0, 1, 2, 3), threads=None, gpu=None, slurm=None):
    return {
        "rank": rank,
        "host": host,
        "pid": 100 + rank,
        "local_rank": local,
        "local_size": size,
        "cores": list(cores),
        "node_cores": 4,
        "threads": threads,
        "launcher": "mpiexec (Open MPI)",
        "slurm": slurm or {},
        "cuda_visible_devices": None,
        "nvidia_devices": False,
        "backend": "cupy" if gpu else "numpy",
        "gpu": gpu,
    }


def _report(ranks, launcher="mpiexec (Open MPI)", nodes=1):
    return {
        "world_size": len(ranks),
        "num_nodes": nodes,
        "launcher": launcher,
        "mpi": {
            "library": "Open MPI v5.0.11",
            "standard": "3.1",
            "mpi4py": "4.1.2",
            "libmpi": ["/x/libmpi.so.40"],
            "libmpi_in_environment": True,
            "mpi4py_libmpi": None,
            "thread_level": "multiple",
            "cuda_claim": False,
        },
        "versions": {"mpidist": "0.1.0", "python": "3.11.7", "numpy": "2.0"},
        "cuda_aware_setting": "auto",
        "cuda_aware": None,
        "nccl": "not available (CuPy is not installed)",
        "nonblocking_allreduce": {"how": "MPI_T", "detail": "ring: set by mpidist through MPI_T", "algorithm": 1},
        "library_warnings": [],
        "ranks": ranks,
    }


def _gpu(device, bus):
    return {"device": device, "name": "H100", "pci_bus_id": bus, "visible": 4}


def test_a_healthy_job_has_no_warnings():
    report = _report([_rank(0, cores=(0, 1)), _rank(1, local=1, cores=(2, 3))])
    assert _doctor.diagnose(report) == []
    text = _doctor.format_report(report, [])
    assert "2 ranks on 1 node" in text and "no problems found" in text
    assert "0-1" in text and "2-3" in text  # each rank's cores
    assert "MPI_Iallreduce  ring: set by mpidist through MPI_T" in text


def test_one_rank_worlds_under_srun_are_named_with_the_fix():
    rank = _rank(0, size=1, slurm={"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    problems = _doctor.diagnose(_report([rank], launcher="srun --mpi=pmi2"), expect_ranks=4)
    text = " ".join(w + f for w, f in problems)
    assert "the MPI world has 1 rank, but 4 were expected" in text
    assert "srun started 4 tasks, but each is a one-rank MPI world" in text
    assert "--mpi=pmix" in text and "--mpi=pmi2" in text


def test_more_ranks_or_threads_than_cores_is_oversubscribed():
    three = [_rank(r, local=r, size=3, cores=(0, 1)) for r in range(3)]
    ((warning, fix),) = _doctor.diagnose(_report(three))
    assert "oversubscribed: 3 ranks on 2 cores (0-1)" in warning and "--cpus-per-task" in fix
    threads = [_rank(r, local=r, cores=(0, 1, 2, 3), threads=4) for r in range(2)]
    ((warning, _),) = _doctor.diagnose(_report(threads))
    assert "2 ranks x 4 threads on 4 cores" in warning


def test_ranks_bound_to_the_same_core_while_others_idle():
    ranks = [_rank(0, cores=(0,)), _rank(1, local=1, cores=(0,)), _rank(2, local=2, size=3, cores=(1, 2, 3))]
    ((warning, fix),) = _doctor.diagnose(_report(ranks))
    assert "ranks 0-1 are bound to overlapping cores" in warning and "--cpu-bind=cores" in fix


def test_ranks_sharing_a_gpu_are_named_per_node():
    ranks = [
        _rank(0, gpu=_gpu(0, "0000:01:00.0")),
        _rank(1, local=1, gpu=_gpu(0, "0000:01:00.0")),
        _rank(2, host="n2", gpu=_gpu(0, "0000:01:00.0")),
        _rank(3, host="n2", local=1, gpu=_gpu(1, "0000:02:00.0")),
    ]
    report = _report(ranks, nodes=2)
    report["cuda_aware"] = False
    ((warning, fix),) = _doctor.diagnose(report)
    assert warning == "on node n1, ranks 0-1 share the GPU at 0000:01:00.0"
    assert "--gpus-per-task=1" in fix
    text = _doctor.format_report(report, _doctor.diagnose(report))
    assert "0: H100 (0000:01:00.0)" in text and "4 on 2 nodes, 2 per node (n1: 0-1; n2: 2-3)" in text
    assert "CUDA-aware MPI  no:" in text and "staged through pinned host memory" in text


def test_cpu_ranks_on_a_node_with_nvidia_devices_get_a_hint():
    rank = _rank(0, size=1)
    rank["nvidia_devices"] = True
    report = _report([rank])
    ((warning, fix),) = _doctor.diagnose(report)
    assert "has NVIDIA devices" in warning and "mpidist[cuda12]" in fix
    report["requested_device"] = "cpu"
    assert _doctor.diagnose(report) == []


def test_launcher_seen_from_a_plain_process(monkeypatch):
    monkeypatch.setattr(_doctor, "_process_name", lambda pid: ("bash", 1))  # no launcher among the ancestors
    assert _doctor.detect_launcher({}) == "none (a one-rank world)"
    assert _doctor.detect_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpiexec (Open MPI)"
    monkeypatch.setattr(_doctor, "_process_name", lambda pid: ("slurmstepd", 1))
    assert _doctor.detect_launcher({"SLURM_STEP_ID": "0", "PMIX_RANK": "0"}) == "srun --mpi=pmix"
    assert _doctor.detect_launcher({"SLURM_STEP_ID": "0", "PMI_FD": "5"}) == "srun --mpi=pmi2"
    assert _doctor.detect_launcher({}).startswith("none (run directly by the batch script")


def test_doctor_under_mpiexec_at_three_ranks():
    result = run_mpi(3, [sys.executable, "-m", "mpidist", "doctor"], timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    out = result.stdout
    assert out.count("mpidist doctor: 3 ranks on 1 node") == 1, result.describe()  # rank 0 only
    assert "launcher        mpiexec (" in out and "3 per node" in out, result.describe()
    assert "MPI library" in out and "CUDA-aware MPI" in out and "NCCL" in out, result.describe()
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\S+\s+\d+/\d+\s", line)]
    assert [row[0] for row in rows] == ["0", "1", "2"] and [row[2] for row in rows] == ["0/3", "1/3", "2/3"]


def test_doctor_json_and_a_wrong_world_size():
    result = run_mpi(2, [sys.executable, "-m", "mpidist", "doctor", "--json"], timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    report = json.loads(result.stdout)
    assert report["world_size"] == 2 and [r["local_rank"] for r in report["ranks"]] == [0, 1]
    # python -m mpidist imports mpidist before MPI starts: Open MPI's ring comes from the environment
    open_mpi = report["mpi"]["library"].startswith("Open MPI")
    expected = {"how": "environment", "algorithm": 1} if open_mpi else {"how": "not applicable", "algorithm": None}
    assert {k: report["nonblocking_allreduce"][k] for k in expected} == expected, result.describe()
    wrong = run_mpi(2, [sys.executable, "-m", "mpidist", "doctor", "--expect-ranks", "3"], timeout=TIMEOUT)
    assert wrong.returncode not in (0, None), wrong.describe()
    assert "the MPI world has 2 ranks, but 3 were expected" in wrong.stderr, wrong.describe()


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--timeout", "-5"], "--timeout: expected a finite number of seconds above 0, got -5"),
        (["--timeout", "nan"], "--timeout: expected a finite number of seconds above 0, got nan"),
        (["--timeout", "0"], "--timeout: expected a finite number of seconds above 0, got 0"),
        (["--expect-ranks", "0"], "--expect-ranks: expected a whole number of at least 1, got 0"),
    ],
)
def test_bad_options_are_one_line_usage_errors(args, complaint):
    # Before: a --timeout the options refuse ended in a traceback, and --expect-ranks 0 started the exchange.
    result = subprocess.run(
        [sys.executable, "-m", "mpidist", "doctor", *args], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 2 and complaint in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


class _NoSharedMemorySplit:
    """A communicator whose MPI refuses ``Split_type`` (as some do): the fallback must still work."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.size = comm.rank, comm.size

    def Split_type(self, *args, **kwargs):
        raise MPI.Exception(MPI.ERR_OTHER)

    def allgather(self, value):
        return self._comm.allgather(value)

    def Split(self, color, key):
        self.split_args = (color, key)
        return self._comm.Split(color, key)


@pytest.mark.parametrize("local_id", [None, "0"])
def test_node_split_falls_back_to_host_name_and_slurm_localid(monkeypatch, local_id):
    if local_id is None:
        monkeypatch.delenv("SLURM_LOCALID", raising=False)
    else:
        monkeypatch.setenv("SLURM_LOCALID", local_id)
    fake = _NoSharedMemorySplit(MPI.COMM_WORLD)
    node = _topology.node_split(fake)
    try:
        assert fake.split_args == (0, 0)  # one host: color 0; key SLURM_LOCALID, else the rank
        assert (node.rank, node.size) == (0, 1)
    finally:
        node.Free()


def test_node_split_uses_shared_memory_when_available():
    node = _topology.node_split(MPI.COMM_WORLD)
    try:
        assert (node.rank, node.size) == (0, 1)
    finally:
        node.Free()
