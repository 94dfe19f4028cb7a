"""``python -m mpidist doctor``: what an MPI job looks like from the inside, and what to fix.

Run it under the launcher you use for real work (``mpiexec -n 4 python -m mpidist doctor``,
``srun --mpi=pmix python -m mpidist doctor``). Every rank describes itself (host, node-local
rank, cores it may run on, its GPU); rank 0 prints one report: the MPI library and version,
the launcher seen, ranks per node and node count, each rank's GPU binding, whether MPI is
CUDA-aware (with the device-buffer self-test), NCCL availability, the algorithm of Open
MPI's nonblocking allreduce and who chose it, and warnings with fixes
(a world of one rank under ``srun``, more ranks or threads than cores, GPUs shared between
ranks).

With ``--expect-ranks N`` it also checks that the MPI world has exactly N ranks and exits 1
when it has not: the job scripts in ``jobs/`` run it first, so that a launcher that starts N
unconnected one-rank jobs (a wrong ``srun --mpi``) fails the job at once.

Collective over ``MPI.COMM_WORLD``; every exchange runs under a timeout (``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

from mpidist._comm.backend import cupy_version, nccl_status
from mpidist._comm.tuning import libnbc_iallreduce_algorithm, ring_setting
from mpidist._errors import format_ranks
from mpidist._tools.cli import positive_int, positive_seconds

if TYPE_CHECKING:
    from mpidist._comm.communicator import Communicator

__all__ = ["DESCRIPTION", "add_arguments", "collect", "detect_launcher", "diagnose", "format_report", "run"]

DESCRIPTION = (
    "Report how this MPI job is set up and what to fix. Run it under your launcher, e.g. "
    "`mpiexec -n 4 python -m mpidist doctor` or `srun --mpi=pmix python -m mpidist doctor`; "
    "rank 0 prints the report. Exit status: 0 (warnings included), 1 when --expect-ranks does "
    "not match the MPI world size."
)

# Ancestor process names that identify a launcher (/proc/PID/comm, at most 15 characters).
_LAUNCHER_PROCESSES = {
    "prterun": "mpiexec (Open MPI)",
    "prted": "mpiexec (Open MPI)",
    "orterun": "mpiexec (Open MPI)",
    "orted": "mpiexec (Open MPI)",
    "hydra_pmi_proxy": "mpiexec (MPICH hydra)",
    "pmi_proxy": "mpiexec (MPICH hydra)",
    "slurmstepd": "srun",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the doctor's options to ``parser``."""
    parser.add_argument(
        "--expect-ranks",
        type=positive_int,
        metavar="N",
        help="fail (exit 1, on every rank) unless the MPI world has exactly N ranks; job scripts pass "
        "$SLURM_NTASKS, so that a launcher that starts N unconnected one-rank jobs is caught",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default=None,
        help="which device the ranks bind, as MPIStrategy(device=...) would (default: MPIDIST_DEVICE, else auto)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="give up when some rank does not join an exchange within this many seconds (default 60)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as one JSON object (rank 0) instead of a table"
    )


# -- what one rank sees ------------------------------------------------------------------------
def _process_name(pid: int) -> tuple[str, int]:
    """(command name, parent pid) of ``pid`` from /proc; ("", 0) when unavailable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return "", 0
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    return name, int(fields[1]) if len(fields) > 1 else 0


def detect_launcher(env: Optional[Mapping[str, str]] = None) -> str:
    """Which launcher started this process, from its ancestors' names and the environment."""
    if env is None:
        env = os.environ
    pid, seen = os.getppid(), 0
    found = ""
    while pid > 1 and seen < 12 and not found:
        name, parent = _process_name(pid)
        found = _LAUNCHER_PROCESSES.get(name, "")
        pid, seen = parent, seen + 1
    if found == "srun":
        if "SLURM_STEP_ID" not in env:
            return "none (run directly by the batch script)"
        if "PMIX_RANK" in env:
            return "srun --mpi=pmix"
        if "PMI_FD" in env or "PMI_JOBID" in env:
            return "srun --mpi=pmi2"
        return "srun (no MPI plugin: --mpi=none?)"
    if found:
        return found
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "mpiexec (Open MPI)"
    if "PMI_RANK" in env or "PMIX_RANK" in env:
        return "an MPI launcher (PMI)"
    return "none (a one-rank world)"


def _mpi_library() -> dict[str, Any]:
    import mpi4py
    from mpi4py import MPI

    from mpidist._comm.cuda_aware import library_cuda_support
    from mpidist._comm.library import libmpi_paths, library_version

    paths = libmpi_paths()
    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    return {
        "library": library_version(),
        "standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "libmpi": paths,
        "libmpi_in_environment": any(
            p.startswith((os.path.realpath(sys.prefix) + os.sep, sys.prefix + os.sep)) for p in paths
        ),
        "mpi4py_libmpi": os.environ.get("MPI4PY_LIBMPI"),
        "thread_level": levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "cuda_claim": library_cuda_support(),
    }


def _versions() -> dict[str, str]:
    import numpy

    from mpidist._version import __version__

    versions = {"mpidist": __version__, "python": platform.python_version(), "numpy": numpy.__version__}
    cupy = cupy_version()
    if cupy is not None:
        versions["cupy"] = cupy
    return versions


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _threads(env: Mapping[str, str]) -> Optional[int]:
    value = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() else None


def _describe_rank(comm: Communicator, launcher: str) -> dict[str, Any]:
    env = os.environ
    slurm = {
        k: env[k]
        for k in (
            "SLURM_JOB_ID",
            "SLURM_NTASKS",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_PROCID",
            "SLURM_LOCALID",
            "SLURM_CPUS_PER_TASK",
            "SLURM_GPUS_PER_TASK",
        )
        if k in env
    }
    return {
        "rank": comm.rank,
        "host": socket.gethostname().split(".")[0],
        "pid": os.getpid(),
        "local_rank": comm.local_rank,
        "local_size": comm.local_size,
        "cores": _cores(),
        "node_cores": os.cpu_count() or 1,
        "threads": _threads(env),
        "launcher": launcher,
        "slurm": slurm,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "nvidia_devices": os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"),
        "backend": comm.backend.name,
        "gpu": comm.backend.device_info(),
    }


def collect(device: Optional[str] = None, timeout: float = 60.0) -> Optional[dict[str, Any]]:
    """Collective over ``MPI.COMM_WORLD``: every rank's description; the report on rank 0, ``None`` elsewhere."""
    from mpi4py import MPI

    from mpidist._comm.communicator import Communicator
    from mpidist._comm.survival import readiness
    from mpidist._options import Options

    overrides: dict[str, Any] = {"timeout": timeout}
    if device is not None:
        overrides["device"] = device
    options = Options.resolve(**overrides)
    launcher = detect_launcher()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = Communicator(MPI.COMM_WORLD, options)
    try:
        mine = _describe_rank(comm, launcher)
        ranks = [json.loads(b) for b in comm.allgather_bytes(json.dumps(mine).encode(), name="doctor")]
        all_gpu = all(r["gpu"] is not None for r in ranks)
        report = None
        if comm.rank == 0:
            report = {
                "world_size": comm.size,
                "num_nodes": comm.num_nodes,
                "launcher": launcher,
                "mpi": _mpi_library(),
                "versions": _versions(),
                "cuda_aware_setting": options.cuda_aware,
                "cuda_aware": bool(comm.cuda_aware) if all_gpu else None,
                "cuda_aware_reason": comm.cuda_awareness.reason,
                "nccl": nccl_status(),
                "nonblocking_allreduce": _nonblocking_allreduce(),
                "fault_tolerance": readiness()[1],
                "library_warnings": [str(w.message) for w in caught],
                "ranks": ranks,
            }
    finally:
        comm.free()
    return report


def _nonblocking_allreduce() -> dict[str, Any]:
    """Local: Open MPI's nonblocking allreduce algorithm, and how it came about (``mpidist/_comm/tuning.py``)."""
    setting = ring_setting()
    return {"how": setting.how, "detail": setting.detail, "algorithm": libnbc_iallreduce_algorithm()}


# -- what is wrong -------------------------------------------------------------------------------
def diagnose(report: dict[str, Any], expect_ranks: Optional[int] = None) -> list[tuple[str, str]]:
    """Problems found in a :func:`collect` report, as ``(warning, fix)`` pairs. Local."""
    problems: list[tuple[str, str]] = []
    ranks = report["ranks"]
    size = report["world_size"]
    r0 = ranks[0]
    step_tasks = int(r0["slurm"].get("SLURM_STEP_NUM_TASKS", "0") or 0)
    job_tasks = int(r0["slurm"].get("SLURM_NTASKS", "0") or 0)
    launcher = report["launcher"]
    if expect_ranks is not None and size != expect_ranks:
        problems.append(
            (
                f"the MPI world has {size} rank{'s' if size != 1 else ''}, but {expect_ranks} were expected",
                "start the ranks with a launcher that connects them: srun --mpi=pmix (Open MPI) or --mpi=pmi2 "
                "(MPICH), or the MPI library's own mpiexec -n N",
            )
        )
    if size == 1 and launcher.startswith("srun") and step_tasks > 1:
        problems.append(
            (
                f"srun started {step_tasks} tasks, but each is a one-rank MPI world: they run as {step_tasks} "
                f"independent jobs (srun's MPI plugin does not match the MPI library; seen: {launcher})",
                "use srun --mpi=pmix for Open MPI, --mpi=pmi2 for MPICH (`srun --mpi=list` shows the plugins), "
                "or mpiexec -n $SLURM_NTASKS",
            )
        )
    elif size == 1 and launcher.startswith("none") and job_tasks > 1:
        problems.append(
            (
                f"this Slurm job has {job_tasks} tasks but the program runs as one rank without a launcher",
                "start it with srun --mpi=pmix (Open MPI) / --mpi=pmi2 (MPICH) or mpiexec -n $SLURM_NTASKS",
            )
        )
    # Cores: per node, the ranks' threads against the cores they may run on.
    by_host: dict[str, list[dict]] = {}
    for r in ranks:
        by_host.setdefault(r["host"], []).append(r)
    for host, local in sorted(by_host.items()):
        usable = set().union(*(set(r["cores"]) for r in local))
        threads = sum(r["threads"] or 1 for r in local)
        if threads > len(usable):
            what = f"{len(local)} rank{'s' if len(local) != 1 else ''}" + (
                f" x {local[0]['threads']} threads" if (local[0]["threads"] or 1) > 1 else ""
            )
            problems.append(
                (
                    f"node {host} is oversubscribed: {what} on {len(usable)} core{'s' if len(usable) != 1 else ''} "
                    f"({format_ranks(usable)}); the ranks take turns and every collective waits for the slowest",
                    "start at most one rank per core (Slurm: --ntasks-per-node, --cpus-per-task and "
                    "OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK), or fewer threads per rank",
                )
            )
        else:
            bound = [r for r in local if len(r["cores"]) < len(usable)]
            shared = sorted(
                {r["rank"] for a in bound for r in bound if r is not a and set(a["cores"]) & set(r["cores"])}
            )
            if shared:
                problems.append(
                    (
                        f"on node {host}, ranks {format_ranks(shared)} are bound to overlapping cores while others "
                        "stay idle",
                        "bind each rank to cores of its own (srun --cpu-bind=cores; Open MPI: --map-by slot:PE=N), "
                        "or do not bind (mpiexec --bind-to none)",
                    )
                )
        gpus: dict[str, list[int]] = {}
        for r in local:
            if r["gpu"] is not None:
                gpus.setdefault(r["gpu"]["pci_bus_id"], []).append(r["rank"])
        for bus, users in sorted(gpus.items()):
            if len(users) > 1:
                problems.append(
                    (
                        f"on node {host}, ranks {format_ranks(users)} share the GPU at {bus}",
                        "start one rank per GPU: --ntasks-per-node equal to the GPUs per node and --gpus-per-task=1 "
                        "(or fewer ranks); mpidist binds GPU (node-local rank % visible GPUs)",
                    )
                )
        cpu_on_gpu_node = [r["rank"] for r in local if r["gpu"] is None and r["nvidia_devices"]]
        if cpu_on_gpu_node and report.get("requested_device", "auto") != "cpu":
            problems.append(
                (
                    f"node {host} has NVIDIA devices, but ranks {format_ranks(cpu_on_gpu_node)} compute with NumPy "
                    "on the CPU",
                    "install CuPy for your CUDA version (pip install 'mpidist[cuda12]' or 'mpidist[cuda13]') "
                    "and check CUDA_VISIBLE_DEVICES; MPIDIST_DEVICE=cpu makes the CPU choice explicit",
                )
            )
    return problems


# -- the report ---------------------------------------------------------------------------------
def _cuda_text(report: dict[str, Any]) -> str:
    claim = report["mpi"]["cuda_claim"]
    claim_text = {
        True: "the library reports CUDA support",
        False: "the library reports no CUDA support",
        None: "the library has no CUDA query",
    }[claim]
    if report["cuda_aware"] is None:
        return f"not used: no GPU in use ({claim_text})"
    if report.get("cuda_aware_reason"):
        return f"{'yes' if report['cuda_aware'] else 'no'}: {report['cuda_aware_reason']} ({claim_text})"
    setting = report["cuda_aware_setting"]
    if setting in ("0", "1"):
        return (
            f"{'yes' if report['cuda_aware'] else 'no'}: forced by MPIDIST_CUDA_AWARE={setting}, self-test "
            f"skipped ({claim_text})"
        )
    if report["cuda_aware"]:
        return f"yes: {claim_text}; device-buffer self-test passed"
    if claim:
        return (
            f"no: {claim_text}, but the device-buffer self-test failed; device buffers are staged "
            "through pinned host memory"
        )
    return (
        f"no: {claim_text}; self-test skipped (a library without CUDA support may crash on device "
        "buffers); device buffers are staged through pinned host memory"
    )


def format_report(report: dict[str, Any], problems: list[tuple[str, str]]) -> str:
    """The human-readable report printed by rank 0."""
    ranks = report["ranks"]
    mpi, versions = report["mpi"], report["versions"]
    size, nodes = report["world_size"], report["num_nodes"]
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(r["host"], []).append(r["rank"])
    per_node = sorted({len(v) for v in hosts.values()})
    per_node_text = "/".join(map(str, per_node))
    r0 = ranks[0]
    slurm = r0["slurm"]
    if "SLURM_JOB_ID" in slurm:
        slurm_text = f"job {slurm['SLURM_JOB_ID']}"
        if "SLURM_NTASKS" in slurm:
            slurm_text += f", SLURM_NTASKS={slurm['SLURM_NTASKS']} as seen by rank 0 (the world size comes from MPI)"
    else:
        slurm_text = "not inside a Slurm job"
    cupy_text = f"CuPy {versions['cupy']}" if "cupy" in versions else "no CuPy"
    devices = sorted({r["backend"] for r in ranks})
    libmpi = ", ".join(mpi["libmpi"]) or "?"
    if mpi["libmpi_in_environment"]:
        libmpi += " (from this Python environment: a pip MPI wheel)"
    if mpi["mpi4py_libmpi"]:
        libmpi += f" (MPI4PY_LIBMPI={mpi['mpi4py_libmpi']})"
    rows = [
        ("mpidist", f"{versions['mpidist']} (Python {versions['python']}, NumPy {versions['numpy']}, {cupy_text})"),
        (
            "MPI library",
            f"{mpi['library']} (MPI {mpi['standard']}), mpi4py {mpi['mpi4py']}, thread level {mpi['thread_level']}",
        ),
        ("libmpi", libmpi),
        ("launcher", report["launcher"]),
        ("Slurm", slurm_text),
        (
            "ranks",
            f"{size} on {nodes} node{'s' if nodes != 1 else ''}, {per_node_text} per node ("
            + "; ".join(f"{h}: {format_ranks(v)}" for h, v in sorted(hosts.items()))
            + ")",
        ),
        ("arrays", ", ".join("NumPy on the CPU" if d == "numpy" else "CuPy on a GPU per rank" for d in devices)),
        ("CUDA-aware MPI", _cuda_text(report)),
        ("NCCL", report["nccl"]),
        ("MPI_Iallreduce", report["nonblocking_allreduce"]["detail"]),
        ("dead ranks", report.get("fault_tolerance", "?")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"mpidist doctor: {size} rank{'s' if size != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''}", ""]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    table = [("rank", "host", "local", "cores", "threads", "GPU", "CUDA_VISIBLE_DEVICES")]
    for r in ranks:
        gpu = r["gpu"]
        gpu_text = f"{gpu['device']}: {gpu['name']} ({gpu['pci_bus_id']})" if gpu else "-"
        table.append(
            (
                str(r["rank"]),
                r["host"],
                f"{r['local_rank']}/{r['local_size']}",
                format_ranks(r["cores"]),
                str(r["threads"]) if r["threads"] else "-",
                gpu_text,
                r["cuda_visible_devices"] if r["cuda_visible_devices"] is not None else "-",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines.append("")
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append("")
    notes = list(report.get("library_warnings", ()))
    if problems:
        lines.append(f"{len(problems)} warning{'s' if len(problems) != 1 else ''}:")
        for warning, fix in problems:
            lines.append(f"  - {warning}")
            lines.append(f"    fix: {fix}")
    else:
        lines.append("no problems found")
    for note in notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the doctor with parsed arguments (see :func:`add_arguments`). Collective."""
    from mpi4py import MPI

    report = collect(args.device, args.timeout)
    world = MPI.COMM_WORLD
    status = 0
    if args.expect_ranks is not None and world.size != args.expect_ranks:
        status = 1
    if report is not None:
        report["requested_device"] = args.device or os.environ.get("MPIDIST_DEVICE", "auto")
        problems = diagnose(report, args.expect_ranks)
        if args.json:
            report["problems"] = [{"warning": w, "fix": f} for w, f in problems]
            print(json.dumps(report, indent=1))
        elif status:
            # Keep it short: with a wrong srun plugin every one of the N one-rank worlds prints this.
            slurm = report["ranks"][0]["slurm"]
            where = f" (Slurm task {slurm['SLURM_PROCID']})" if "SLURM_PROCID" in slurm else ""
            print(
                f"mpidist doctor: ERROR{where}: {problems[0][0]} (launcher seen: {report['launcher']}).\n"
                f"  fix: {problems[0][1]}",
                file=sys.stderr,
            )
        else:
            print(format_report(report, problems))
        sys.stdout.flush()
    return status
