"""MPI jobs across nodes: a cluster of network-namespace nodes on this machine (docs/multinode.md).

Marked ``multinode``: CTest runs these once per MPI (``python3 tests/run.py --system``, or
``CI=true``), with that MPI's virtual environment. ``tests/system/cluster/nodes-up.sh`` creates 2 nodes
(own host names, addresses on a private /24, private ``/tmp``) and ``nodes-down.sh`` removes them
afterwards, also when a test fails, and through its watchdog should this process be killed.

Jobs of 2 nodes x 2 ranks start with the MPI's own ``mpiexec`` on the first node, reaching the
second through the cluster's ssh stand-in (Open MPI: ``plm_ssh_agent``; MPICH: ``-launcher-exec``),
under a timeout that kills the launcher's whole process tree. They run
``tests/helpers/samples/multinode_job.py``, which writes one report per rank; expectations follow from
rank and size. A node is taken away mid-job by setting its link down, or by SIGKILLing its ranks
(and, with fault tolerance, its MPI daemon: ``tests/helpers/samples/ft_node_job.py``).
A Slurm with one ``slurmd`` per node runs the job scripts on both nodes, and ``jobs/train.sbatch``
preempted, requeued and resumed there (``tests/helpers/requeue.py``).

Not root: skipped with the reason, unless the system tests were asked for
(``MPIDIST_TEST_SYSTEM=1``: ``tests/run.py --system``, ``CI=true``), which makes a failed set-up
an error. The checkout, the venv and the working files (under ``/var/tmp``) must lie where every
node sees them, outside the paths each node has its own copy of (``/tmp``): the fixture checks
that first (``tests/helpers/node_paths.py``) and fails every test with one line if not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import requeue
from mpirun import _kill_job, mpi_env, run_command
from node_paths import WORK_ROOT, check_nodes_see
from paths import CLUSTER, REPO, SAMPLES, STANDIN
from test_slurm import slurm_down

pytestmark = pytest.mark.multinode

JOB = SAMPLES / "multinode_job.py"
NODES, PER_NODE = 2, 2
SIZE = NODES * PER_NODE
DEADLINE = 3  # seconds: the collectives' timeout in the fault scenarios
SLACK = 6  # seconds a loaded machine may add to a deadline
JOB_TIMEOUT = 120


def _flavour() -> str:
    from mpi4py import MPI

    return "openmpi" if "open mpi" in MPI.Get_library_version().lower() else "mpich"


def _work_dir(prefix: str) -> Path:
    """A folder every node sees (not under /tmp)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=WORK_ROOT))
    path.chmod(0o755)
    return path


class Cluster:
    def __init__(self, state: Path) -> None:
        self.state = state
        env = {}
        for line in (state / "nodes.env").read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                key, value = line.split("=", 1)
                env[key] = value.strip('"')
        self.env = env
        self.names = env["NAMES"].split()
        self.flavour = _flavour()

    def launcher(self, n: int = SIZE) -> list[str]:
        """``mpiexec`` on the first node, reaching the others through the ssh stand-in."""
        bindir = Path(sys.executable).parent
        if self.flavour == "openmpi":
            subnet = self.env["SUBNET"]
            command = [
                bindir / "mpiexec",
                "--hostfile",
                self.state / "hostfile.openmpi",
                "-n",
                n,
                "--map-by",
                f"ppr:{PER_NODE}:node",
                "--prtemca",
                "plm_ssh_agent",
                self.state / "agent",
                "--prtemca",
                "oob_tcp_if_include",
                subnet,
                "--mca",
                "btl_tcp_if_include",
                subnet,
            ]
        else:
            command = [
                bindir / "mpiexec",
                "-launcher",
                "ssh",
                "-launcher-exec",
                self.state / "agent",
                "-f",
                self.state / "hostfile.mpich",
                "-n",
                n,
                "-ppn",
                PER_NODE,
                "-iface",
                self.env["IFACE"],
            ]
        return [str(self.state / "on"), self.names[0], *map(str, command)]

    def environment(self, **extra: str) -> dict:
        env = mpi_env(dict(os.environ, PYTHONDONTWRITEBYTECODE="1", MULTINODE_PER_NODE=str(PER_NODE), **extra))
        env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)  # oversubscribe would put every rank on node0
        env.pop("MPIEXEC_TIMEOUT", None)
        return env

    def processes(self, node: int) -> list[int]:
        """Every process running on ``node`` (in its network namespace) but the namespace's holder."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.env["NAMESPACES"].split()[node]], capture_output=True, text=True, timeout=30
        )
        holder = self.env["PIDS"].split()[node]
        return [int(p) for p in listed.stdout.split() if p != holder]

    def set_link(self, node: int, state: str) -> None:
        """Set the host end of ``node``'s link ``"down"`` or ``"up"``.

        Up again, every node also forgets the neighbours it failed to resolve meanwhile: until it
        retried them, connecting to them fails with "No route to host".
        """
        subprocess.run(["ip", "link", "set", self.env[f"VETH_{node}"], state], check=True, timeout=30)
        if state == "up":
            for namespace in self.env["NAMESPACES"].split():
                subprocess.run(["ip", "-n", namespace, "neigh", "flush", "all"], check=True, timeout=30)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        asked = os.environ.get("MPIDIST_TEST_SYSTEM") == "1"
        (pytest.fail if asked else pytest.skip)(
            "a cluster of network-namespace nodes needs root "
            "(tests/system/cluster/nodes-up.sh creates namespaces and a bridge)"
        )
    unseen = check_nodes_see()
    if unseen is not None:
        pytest.fail(f"multinode: {unseen}", pytrace=False)
    state = _work_dir("mpidist-nodes-") / "cluster"
    env = dict(
        os.environ,
        MPIDIST_NODES=str(NODES),
        MPIDIST_NODES_SLOTS=str(PER_NODE),
        MPIDIST_NODES_OWNER_PID=str(os.getpid()),
    )
    start = time.monotonic()
    up = subprocess.run(
        ["bash", str(CLUSTER / "nodes-up.sh"), str(state)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if up.returncode != 0:
        state.parent.rmdir() if not state.exists() else None
        pytest.fail(f"nodes-up.sh exited {up.returncode}:\n{up.stdout}\n{up.stderr}")
    print(f"{NODES} nodes up in {time.monotonic() - start:.1f} s ({state})")
    try:
        yield Cluster(state)
    finally:
        down = subprocess.run(
            ["bash", str(CLUSTER / "nodes-down.sh"), str(state)],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        os.rmdir(state.parent)
        assert down.returncode == 0, f"nodes-down.sh exited {down.returncode}:\n{down.stdout}\n{down.stderr}"


@pytest.fixture
def out():
    path = _work_dir("mpidist-multinode-")
    yield path
    subprocess.run(["rm", "-rf", str(path)], timeout=60)


def reports(out: Path) -> dict[int, dict]:
    found = {}
    for path in out.glob("rank*.json"):
        found[int(path.stem[4:])] = json.loads(path.read_text())
    return found


def describe(result, out: Path) -> str:
    return f"{result.describe()}\n--- reports ---\n{json.dumps(reports(out), indent=1)[-6000:]}"


def test_doctor_sees_two_nodes(cluster):
    result = run_command(
        [*cluster.launcher(), sys.executable, "-m", "mpidist", "doctor", "--expect-ranks", SIZE],
        JOB_TIMEOUT,
        env=cluster.environment(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.describe()
    assert f"mpidist doctor: {SIZE} ranks on {NODES} nodes" in result.stdout, result.describe()
    placement = "; ".join(
        f"{name}: {k * PER_NODE}-{k * PER_NODE + PER_NODE - 1}" for k, name in enumerate(cluster.names)
    )
    assert placement in result.stdout, result.describe()


@pytest.mark.parametrize("device", ["cpu", "standin"])
def test_values_reductions_input_and_checkpoints_across_nodes(cluster, out, device):
    extra = {"MULTINODE_OUT": str(out), "MULTINODE_CKPT": str(out / "ckpt")}
    if device == "standin":  # the CuPy stand-in: one "GPU" per node-local rank
        extra.update(
            MULTINODE_DEVICE="gpu",
            MPIDIST_STANDIN_GPUS=str(PER_NODE),
            PYTHONPATH=os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]),
        )
    result = run_command(
        [*cluster.launcher(), sys.executable, JOB, "basics"], JOB_TIMEOUT, env=cluster.environment(**extra), cwd=REPO
    )
    found = reports(out)
    assert result.returncode == 0 and sorted(found) == list(range(SIZE)), describe(result, out)
    for rank, report in found.items():
        failed = {name: what for name, what in report["checks"].items() if what != "ok"}
        assert not failed, f"rank {rank}: {failed}"
        assert report["host"] == cluster.names[rank // PER_NODE]
        # The default (hierarchical not set) across nodes: under Open MPI two-level from TWO_LEVEL_FROM bytes (every
        # piece of the 8 MiB reduction), flat below; under MPICH flat at every size, the two-level algorithm not built.
        large = "Hierarchical" if cluster.flavour == "openmpi" else "Flat"
        assert report["auto_picks"] == {"8000": ["Flat"], str(8 << 20): [large]}, report["auto_picks"]
        assert report["auto_two_level_built"] == (cluster.flavour == "openmpi")
        assert report["compressed_algorithm"] == "Hierarchical"  # compressed: two-level under either MPI
        assert report["local_rank"] == rank % PER_NODE and report["num_nodes"] == NODES
        if device == "standin":
            assert report["device_id"] == rank % PER_NODE, report  # GPU = node-local rank
            assert "device" in report["checks"]
        else:
            assert report["device_id"] is None
        # The restore reads this rank's share of the save from the shared file system, and
        # receives the rest from the other ranks (counted by /proc/self/io when it comes by TCP).
        share = report["checkpoint_bytes"] // SIZE
        assert share <= report["restore_rchar"] <= report["checkpoint_bytes"] + (4 << 20), report
    print({rank: report["restore_rchar"] for rank, report in sorted(found.items())})


def test_mismatch_bad_argument_and_deadline_across_nodes(cluster, out):
    result = run_command(
        [*cluster.launcher(), sys.executable, JOB, "safety"],
        JOB_TIMEOUT,
        env=cluster.environment(MULTINODE_OUT=str(out), MULTINODE_TIMEOUT=str(DEADLINE)),
        cwd=REPO,
    )
    found = reports(out)
    assert sorted(found) == list(range(SIZE)), describe(result, out)
    last, away = SIZE - 1, (SIZE - 1) // PER_NODE * PER_NODE  # both on the last node
    for rank, report in found.items():
        errors = report["errors"]
        assert errors["mismatch"]["type"] == "CollectiveMismatchError", (rank, errors)
        assert f"rank {last}: #2 allreduce(sum) of 'reduce' float64[3]" in errors["mismatch"]["message"]
        if rank == last:
            assert errors["bad-argument"]["type"] == "ValueError", errors
        else:
            assert errors["bad-argument"]["type"] == "CollectiveMismatchError", (rank, errors)
        assert "unknown reduce op 'median'" in errors["bad-argument"]["message"]
        assert errors["after"]["type"] is None, errors
        if rank == away:
            continue
        deadline = errors["deadline"]
        assert deadline["type"] == "CollectiveTimeoutError" and deadline["missing"] == [away], (rank, deadline)
        assert DEADLINE <= deadline["elapsed"] <= DEADLINE + SLACK, (rank, deadline)


def _start(cluster, out, **extra) -> subprocess.Popen:
    env = cluster.environment(MULTINODE_OUT=str(out), MULTINODE_TIMEOUT=str(DEADLINE), **extra)
    return subprocess.Popen(
        [*cluster.launcher(), sys.executable, str(JOB), "loop"],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        errors="replace",
    )


def _wait_for(out: Path, pattern: str, count: int, seconds: float, proc=None) -> list[Path]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found = sorted(out.glob(pattern))
        if len(found) >= count or (proc is not None and proc.poll() is not None):
            return found
        time.sleep(0.1)
    return sorted(out.glob(pattern))


def _finish(proc: subprocess.Popen, seconds: float) -> tuple[bool, str]:
    """(whether the launcher ended by itself within ``seconds``, its output); then kill what is left."""
    try:
        proc.wait(timeout=seconds)
        ended = True
    except subprocess.TimeoutExpired:
        ended = False
    _kill_job(proc) if proc.poll() is None else None
    return ended, proc.stdout.read()[-4000:] if proc.stdout else ""


def test_node_link_down_every_rank_names_the_other_node(cluster, out):
    # Without abort_on_error every rank that raises writes its report and leaves (status 3): with
    # it, the first rank to raise ends the job, possibly before the others reached the deadline.
    proc = _start(cluster, out, MPIDIST_ABORT_ON_ERROR="0")
    try:
        ready = _wait_for(out, "rank*.ready", SIZE, JOB_TIMEOUT, proc)
        assert len(ready) == SIZE, f"the job did not start: {_finish(proc, 0)[1]}"
        cluster.set_link(1, "down")
        down_at = time.time()
        found = _wait_for(out, "rank*.json", SIZE, DEADLINE + SLACK)
        ended, output = _finish(proc, 5)
    finally:
        cluster.set_link(1, "up")
        if proc.poll() is None:
            _kill_job(proc)
    found = reports(out)
    # The ranks on the launcher's node must see it. Those behind the lost link see it too, unless
    # the launcher ended them first (once a rank failed it kills its ssh stand-in, here the remote
    # daemon itself).
    assert set(found) >= set(range(PER_NODE)), f"reports from {sorted(found)} only\n{output}"
    for rank, report in found.items():
        node = rank // PER_NODE
        others = [r for r in range(SIZE) if r // PER_NODE != node]
        assert report["error"] in ("CollectiveTimeoutError", "RankLeftError"), report
        assert set(report["missing"]) == set(others), (rank, report)
        assert report["waited"] <= DEADLINE + SLACK and report["wall"] - down_at <= DEADLINE + SLACK, (rank, report)
    # mpiexec on the first node cannot reach the second node's daemon to end its ranks: the
    # harness ends the launcher's process tree (on a cluster, srun --kill-on-bad-exit or the
    # end of the Slurm step does).
    print(f"reports from ranks {sorted(found)}; launcher ended by itself: {ended}")


def test_killed_node_ends_the_job(cluster, out):
    proc = _start(cluster, out, MPIDIST_ABORT_ON_ERROR="1")
    try:
        ready = _wait_for(out, "rank*.ready", SIZE, JOB_TIMEOUT, proc)
        assert len(ready) == SIZE, f"the job did not start: {_finish(proc, 0)[1]}"
        victims = [json.loads((out / f"rank{r}.ready").read_text())["pid"] for r in range(SIZE) if r // PER_NODE == 1]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        ended, output = _finish(proc, DEADLINE + SLACK + 10)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert ended, f"the launcher was still running {elapsed:.0f} s after the node's ranks were killed\n{output}"
    assert proc.returncode != 0, output
    for rank, report in reports(out).items():  # survivors that saw it before the launcher ended them
        assert rank // PER_NODE == 0 and set(report["missing"]) <= {2, 3}, (rank, report)


# ULFM's heartbeat failure detector (off by default), tuned for the tests: a rank that stops answering is
# declared failed about three timeouts after the link went down (two ranks behind it; measured in
# docs/fault-tolerance.md).
DETECTOR_TIMEOUT = 1.0  # seconds
DETECTOR = {
    "OMPI_MCA_mpi_ft_detector": "true",
    "OMPI_MCA_mpi_ft_detector_period": "0.2",
    "OMPI_MCA_mpi_ft_detector_timeout": str(DETECTOR_TIMEOUT),
}


def _start_tolerant(cluster, out, timeout: float = 60, **extra: str) -> subprocess.Popen:
    """``ft_node_job.py`` across the nodes with fault tolerance: ``--with-ft ulfm`` (Open MPI only)."""
    if cluster.flavour != "openmpi":
        pytest.skip("only Open MPI (ULFM) lets survivors carry on")
    launcher = cluster.launcher()
    launcher[3:3] = ["--with-ft", "ulfm"]  # after on NODE mpiexec
    env = cluster.environment(MPIDIST_FAULT_TOLERANCE="1", OMPI_MCA_async_mpi_finalize="1", **extra)
    return subprocess.Popen(
        [*launcher, sys.executable, str(SAMPLES / "ft_node_job.py"), str(out), str(timeout)],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        errors="replace",
    )


def _carried_on(found: dict[int, dict], since: float, within: float) -> float:
    """Node 0's ranks noticed node 1's death within ``within`` s of ``since`` and finished every step once, on
    2 ranks; returns the slowest one's time to notice."""
    assert {0, 1} <= set(found), found
    for rank in (0, 1):
        report = found[rank]
        assert report.get("final") == [rank, 2] and report["w"] == 300.0, (rank, report)
        [failure] = report["failures"]
        assert failure["failed_ranks"] == [2, 3] and failure["raised_at"] - since < within, (rank, failure)
    return max(found[r]["failures"][0]["raised_at"] for r in (0, 1)) - since


@pytest.mark.parametrize("daemon", [False, True], ids=["ranks", "ranks-and-daemon"])
def test_killed_node_with_fault_tolerance(cluster, out, daemon):
    """Fault tolerance across nodes: node 1's ranks killed, node 0's carry on and finish every step once;
    with node 1's MPI daemon killed too, Open MPI 5.0's runtime ends the job at once (it cannot lose a daemon)."""
    # The failure detector changes nothing here: node 0's ranks learn of the deaths from Open MPI's runtime.
    proc = _start_tolerant(cluster, out, **(DETECTOR if daemon else {}))
    try:
        ready = _wait_for(out, "rank*.ready", SIZE, JOB_TIMEOUT, proc)
        assert len(ready) == SIZE, f"the job did not start: {_finish(proc, 0)[1]}"
        if daemon:  # every process of the node: the ranks and prted
            victims = cluster.processes(1)
        else:
            victims = [json.loads((out / f"rank{r}.ready").read_text())["pid"] for r in range(PER_NODE, SIZE)]
        killed_at = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        ended, output = _finish(proc, 60)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert ended, output
    found = reports(out)
    if daemon:
        # "PRTE has lost communication with a remote daemon", or "A daemon failed to report back"; the
        # launcher ends node 0's ranks before any of them noticed, whatever the failure detector says.
        assert "daemon" in output and elapsed < SLACK, (elapsed, output)
        assert found == {}, found
        print(f"node 1 killed with its daemon: the launcher ended the job in {elapsed:.2f} s, status {proc.returncode}")
        return
    assert proc.returncode == 0, output
    noticed = _carried_on(found, killed_at, 5)
    print(f"node 1's ranks killed: node 0 noticed within {noticed * 1e3:.0f} ms and trained on")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_crashed_node_with_fault_tolerance(cluster, out):
    """Node 1 stops answering for good, as a node that crashed or lost power: its link goes down, then every
    process of it dies, but the launcher's ssh client to it (here the stand-in's own process, the launcher's
    child on node 1) is stopped rather than ended, as a real one waits on a host that vanished. With ULFM's
    failure detector node 0 carries on and finishes every step once; the launcher waits for node 1's daemon
    (until its TCP keepalive gives up, minutes later, and ends the job: docs/fault-tolerance.md)."""
    proc = _start_tolerant(cluster, out, **DETECTOR)
    stopped = []
    try:
        ready = _wait_for(out, "rank*.ready", SIZE, JOB_TIMEOUT, proc)
        assert len(ready) == SIZE, f"the job did not start: {_finish(proc, 0)[1]}"
        cluster.set_link(1, "down")
        crashed_at = time.time()
        victims = cluster.processes(1)
        parents = {pid: _parent(pid) for pid in victims}
        stopped = [pid for pid in victims if parents[pid] not in victims]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP if pid in stopped else signal.SIGKILL)
        _wait_for(out, "rank*.json", PER_NODE, 3 * DETECTOR_TIMEOUT + SLACK + 30)
        ended, output = _finish(proc, 3)  # then kills what is left
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        cluster.set_link(1, "up")
        if proc.poll() is None:
            _kill_job(proc)
    assert stopped and not ended, (stopped, output)  # the launcher still waited for node 1's daemon
    noticed = _carried_on(reports(out), crashed_at, 3 * DETECTOR_TIMEOUT + SLACK)
    print(f"node 1 crashed: node 0 noticed within {noticed:.2f} s and trained on; the launcher waited")


@pytest.mark.parametrize("detector", [True, False], ids=["detector", "deadline"])
def test_link_down_with_fault_tolerance(cluster, out, detector):
    """Node 1's link goes down (the node stays up). With ULFM's failure detector on, each side declares the
    other failed: node 0 (rank 0's side) carries on and finishes every step once, node 1 stops (CutOffError).
    Without the detector nothing in Open MPI notices: rank 0's side raises the deadline's
    CollectiveTimeoutError naming ranks 2-3, as without fault tolerance."""
    proc = _start_tolerant(cluster, out, timeout=60 if detector else DEADLINE, **(DETECTOR if detector else {}))
    try:
        ready = _wait_for(out, "rank*.ready", SIZE, JOB_TIMEOUT, proc)
        assert len(ready) == SIZE, f"the job did not start: {_finish(proc, 0)[1]}"
        cluster.set_link(1, "down")
        down_at = time.time()
        expected = (
            ["rank0.json", "rank1.json", "rank2.json", "rank3.json"] if detector else ["rank0.json", "rank1.json"]
        )
        found_files = _wait_for(out, "rank*.json", len(expected), 60 if detector else DEADLINE + SLACK)
        cluster.set_link(1, "up")  # the launcher on node 0 hears from node 1's daemon again and can end
        ended, output = _finish(proc, 30 if detector else 0)
    finally:
        cluster.set_link(1, "up")
        if proc.poll() is None:
            _kill_job(proc)
    assert [p.name for p in found_files][: len(expected)] == expected, output
    found = reports(out)
    if not detector:
        for rank in (0, 1):
            report = found[rank]
            assert report["error"] == "CollectiveTimeoutError" and report["missing"] == [2, 3], (rank, report)
            assert DEADLINE <= report["raised_at"] - down_at <= DEADLINE + SLACK, (rank, report)
        print(f"link down, no detector: ranks 0-1 raised the deadline's error naming ranks 2-3 ({DEADLINE} s)")
        return
    noticed = _carried_on(found, down_at, 3 * DETECTOR_TIMEOUT + SLACK)
    for rank in (2, 3):
        report = found[rank]
        noticed_there = report["raised_at"] - down_at
        assert report["error"] == "CutOffError" and noticed_there < 3 * DETECTOR_TIMEOUT + SLACK, (rank, report)
    assert ended, f"the launcher did not end within 30 s of the link coming back\n{output}"
    print(f"link down: node 0 noticed within {noticed:.2f} s and trained on; node 1 stopped")


# -- Slurm across the nodes --------------------------------------------------------------------
SLURM_JOBS_TIMEOUT = 300  # seconds, all jobs together
SLURM_TASKS = [
    f"--nodes={NODES}",
    f"--ntasks={SIZE}",
    f"--ntasks-per-node={PER_NODE}",
    "--cpus-per-task=1",
    "--gpus-per-task=1",
]
PREEMPT_EPOCHS = 60  # long enough to be signalled while it trains (0.1-0.3 s an epoch here)


@pytest.fixture(scope="module")
def slurm(cluster):
    state = _work_dir("mpidist-slurm-")
    env = dict(
        os.environ,
        MPIDIST_SLURM_NODES_DIR=str(cluster.state),
        MPIDIST_SLURM_CPUS=str(PER_NODE),
        MPIDIST_SLURM_GPUS=str(PER_NODE),
        MPIDIST_SLURM_OWNER_PID=str(os.getpid()),
    )
    up = subprocess.run(
        ["bash", str(CLUSTER / "slurm-up.sh"), str(state)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if up.returncode != 0:
        subprocess.run(["rm", "-rf", str(state)], timeout=60)
        pytest.fail(f"slurm-up.sh exited {up.returncode}:\n{up.stdout}\n{up.stderr}")
    env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"))
    try:
        yield env
    finally:
        slurm_down(state, env)


SLURM_JOBS = [("train", "srun"), ("train", "mpiexec"), ("tests", "srun"), ("tests", "mpiexec")]


@pytest.fixture(scope="module")
def slurm_finished(slurm, cluster):
    """Submit train.sbatch and tests.sbatch on 2 nodes x 2 tasks under each launcher.

    Returns {(script, launcher): (fields, output)}.
    """
    from test_slurm import FINAL_STATES, _scontrol_jobs

    workdir = _work_dir("mpidist-slurm-jobs-")
    ids = {}
    try:
        for script, launcher in SLURM_JOBS:
            env = requeue.job_env(slurm, launcher)
            args = (
                ["--epochs", "1", "--checkpoint-dir", str(workdir / f"ckpt-{launcher}")]
                if script == "train"
                else [str(REPO / "tests" / "parallel" / "test_strategy.py"), "-k", "reduce"]
            )
            command = [
                "sbatch",
                "--parsable",
                f"--job-name=mpidist-{script}-{launcher}",
                "--time=5",
                f"--output={workdir}/{script}-{launcher}.out",
                *SLURM_TASKS,
                str(REPO / "jobs" / f"{script}.sbatch"),
                *args,
            ]
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=60, env=env, cwd=REPO, stdin=subprocess.DEVNULL
            )
            assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
            ids[(script, launcher)] = result.stdout.strip().split(";")[0]
        final, end = {}, time.monotonic() + SLURM_JOBS_TIMEOUT
        while len(final) < len(ids) and time.monotonic() < end:
            known = _scontrol_jobs(slurm)
            for key, job_id in ids.items():
                fields = known.get(job_id, {"JobState": "VANISHED"})
                if key not in final and (fields.get("JobState") in FINAL_STATES or fields["JobState"] == "VANISHED"):
                    final[key] = fields
            time.sleep(0.3)
        results = {}
        for key in ids:
            path = workdir / f"{key[0]}-{key[1]}.out"
            results[key] = (
                final.get(key, {"JobState": "NOT FINISHED"}),
                path.read_text(errors="replace") if path.exists() else "(no output)",
            )
        return results
    finally:
        pending = [job_id for key, job_id in ids.items()]
        subprocess.run(["scancel", *pending], capture_output=True, timeout=30, env=slurm)
        subprocess.run(["rm", "-rf", str(workdir)], timeout=60)


@pytest.mark.parametrize("script,launcher", SLURM_JOBS, ids=[f"{s}-{launcher}" for s, launcher in SLURM_JOBS])
def test_slurm_jobs_on_two_nodes(slurm_finished, script, launcher):
    fields, output = slurm_finished[(script, launcher)]
    state = f"JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')}"
    report = f"{state}\n--- output ---\n{output[:2500]}\n...\n{output[-2500:]}"
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", report
    # The world-size check saw every task, one rank per (stand-in) GPU on each node.
    assert f"mpidist doctor: {SIZE} ranks on {NODES} nodes" in output, report
    assert "node0: 0-1; node1: 2-3" in output, report
    if script == "train":
        assert "epoch 1/1" in output and "final held-out accuracy" in output, report
    else:
        assert " passed" in output and " failed" not in output, report


def test_slurm_job_on_two_nodes_requeued_after_preemption_resumes_to_the_same_result(slurm):
    # jobs/train.sbatch under srun on 2 nodes x 2 tasks, signalled as --signal=B:USR1 does: every
    # rank saves at the same step, the script requeues the job, and it resumes on both nodes.
    workdir = _work_dir("mpidist-slurm-preempt-")
    name, env = "preempt-two-nodes", requeue.job_env(slurm, "srun")
    job_id = requeue.submit_training(env, workdir, name, workdir / name, PREEMPT_EPOCHS, SLURM_TASKS)
    try:
        requeue.training_started(workdir, name, PREEMPT_EPOCHS)
        requeue.requeue_resumes_to_the_uninterrupted_result(env, job_id, workdir, name, PREEMPT_EPOCHS, SLURM_TASKS)
        out = requeue.output(workdir, name)
        assert out.count(f"mpidist doctor: {SIZE} ranks on {NODES} nodes") == 2, out[-6000:]  # both runs
    finally:
        requeue.run(["scancel", job_id], 30, env=env)  # a no-op once it ended
        subprocess.run(["rm", "-rf", str(workdir)], timeout=60)
