"""An mpidist program for jobs that span several nodes; tests/system/test_multinode.py launches it.

    mpiexec (N ranks, P per node) python multinode_job.py SCENARIO

Every rank writes ``$MULTINODE_OUT/rank<R>.json`` (launchers may interleave standard output),
with its host, node-local rank and what the scenario found. Expectations are derived from
rank, size and ``MULTINODE_PER_NODE`` (ranks per node, consecutive ranks share a node):

- ``basics``: node detection, node-local rank and the GPU it binds (``MULTINODE_DEVICE=gpu``
  with the CuPy stand-in on ``PYTHONPATH``), plain and hierarchical reductions, the default's
  choice between the two (``auto_picks``: the algorithm of each call of a small and a large
  reduction, whose results equal forced flat ones), fused and flat variable updates, input
  sharding, checkpoint save and restore into ``MULTINODE_CKPT`` with the bytes each rank read
  (``/proc/self/io``). A failed check is recorded, not raised.
- ``safety``: a shape that differs on the last rank, an invalid reduce op on the last rank, and
  a deadline (the first rank of the last node stays away from a barrier), each recorded as the
  error every rank raised.
- ``loop``: collectives until one fails (a node taken away from outside). The rank writes
  ``rank<R>.ready`` (its pid) once the loop runs, then on failure the error, the ranks it names
  and the seconds the failing collective waited; it re-raises (``abort_on_error`` then ends the
  job) or, without it, leaves with status 3.
"""

import json
import os
import socket
import sys
import time
import traceback

import numpy as np

import mpidist as md

scenario = sys.argv[1]
out = os.environ["MULTINODE_OUT"]
per_node = int(os.environ.get("MULTINODE_PER_NODE", "2"))
timeout = float(os.environ.get("MULTINODE_TIMEOUT", "3"))
report = {"host": socket.gethostname(), "pid": os.getpid(), "checks": {}}


def write(name, data):
    path = os.path.join(out, name)
    with open(path + ".part", "w") as f:
        json.dump(data, f)
    os.replace(path + ".part", path)


def check(name):
    """Run the decorated function now; record 'ok' or the failure under ``name``."""

    def run(fn):
        try:
            result = fn()
            report["checks"][name] = "ok" if result is None else result
        except Exception:  # recorded for the test to show; the other checks still run
            report["checks"][name] = "FAILED: " + traceback.format_exc(limit=4)
        return fn

    return run


def read_bytes():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


def basics():
    device = os.environ.get("MULTINODE_DEVICE", "cpu")
    strategy = md.MPIStrategy(device=device, timeout=60)
    comm = strategy.communicator
    rank, size = comm.rank, comm.size
    report.update(
        rank=rank,
        size=size,
        local_rank=comm.local_rank,
        local_size=comm.local_size,
        num_nodes=comm.num_nodes,
        device_id=strategy.backend.device_id,
    )
    expected_nodes = -(-size // per_node)

    @check("nodes")
    def _():
        assert comm.num_nodes == expected_nodes, (comm.num_nodes, expected_nodes)
        assert comm.local_rank == rank % per_node, (comm.local_rank, rank)
        assert comm.local_size == min(per_node, size - rank // per_node * per_node)
        hosts = comm.allgather_bytes(socket.gethostname().encode(), name="hosts")
        assert len(set(hosts)) == expected_nodes, hosts
        assert hosts[rank // per_node * per_node] == hosts[rank] != hosts[(rank + per_node) % size] or size <= per_node

    if device == "gpu":

        @check("device")
        def _():
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            assert strategy.backend.device_id == comm.local_rank % count, (strategy.backend.device_id, count)
            assert cupy.cuda.Device().id == strategy.backend.device_id

    total = sum(range(1, size + 1))
    xp = strategy.backend.xp

    def host(a):
        return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)

    for hierarchical in (False, True):
        s = md.MPIStrategy(device=device, timeout=60, hierarchical=hierarchical, piece_bytes=4096)

        @check(f"reduce-{'hierarchical' if hierarchical else 'flat'}")
        def _():
            for n in (1, 7, 3000):  # one piece and several pieces of piece_bytes
                mine = xp.asarray(np.arange(n, dtype=np.float64) + rank + 1)
                got = host(s.communicator.allreduce(mine))
                assert np.array_equal(got, np.arange(n) * size + total), (n, got[:4])
                got = host(s.communicator.allreduce(xp.asarray(np.full(n, rank, np.int64)), "max"))
                assert (got == size - 1).all()
            value = s.reduce("mean", md.PerReplica({rank: xp.asarray(np.full(5, float(rank)))}))
            assert np.allclose(host(value), (size - 1) / 2)

        s.free()

    auto = md.MPIStrategy(device=device, timeout=60)  # hierarchical not set: mpidist decides per reduction
    forced_flat = md.MPIStrategy(device=device, timeout=60, hierarchical=False)

    @check("reduce-auto")
    def _():
        picked = report["auto_picks"] = {}
        for n in (1000, 1 << 20):  # 7.8 KiB and 8 MiB of float64: a small and a large reduction
            mine = np.arange(n, dtype=np.float64) % 997 + rank + 1  # sums exact in any order
            expected = (np.arange(n) % 997 + 1) * size + size * (size - 1) // 2
            for how, reduce in (
                ("allreduce", lambda s: host(s.communicator.allreduce(xp.asarray(mine)))),
                ("strategy.reduce", lambda s: host(s.reduce("sum", xp.asarray(mine), out=xp.empty(n)))),
            ):
                got, flat = reduce(auto), reduce(forced_flat)
                assert np.array_equal(got, expected) and np.array_equal(got, flat), (how, n, got[:3], flat[:3])
            # what each call of the auto strategy took: the whole array (allreduce), its pieces (strategy.reduce)
            algorithms = auto.communicator._algorithms
            pieces = {min(n * 8, auto.options.piece_bytes)}
            picked[str(n * 8)] = sorted({type(algorithms.choose(b)).__name__ for b in (n * 8, *pieces)})
        report["auto_two_level_built"] = auto.communicator._algorithms.hierarchical is not None

    auto.free()
    forced_flat.free()

    compressed = md.MPIStrategy(device=device, timeout=60, compression="bf16", piece_bytes=4096)

    @check("reduce-compressed")
    def _():
        # across nodes a compressed reduction takes the two-level algorithm under either MPI (16 bits between leaders)
        report["compressed_algorithm"] = type(compressed.communicator._algorithms.choose_compressed()).__name__
        for n in (40, 3000):  # one piece and several: small integers, exact in bfloat16, node sums and totals too
            mine = xp.asarray((np.arange(n) % 7 + rank + 1).astype(np.float32))
            got = host(compressed.communicator.allreduce(mine))
            assert np.array_equal(got, (np.arange(n) % 7 + 1) * size + size * (size - 1) // 2), (n, got[:4])
            got = host(compressed.reduce("mean", mine))
            assert np.array_equal(got, np.arange(n) % 7 + 1 + (size - 1) / 2), (n, got[:4])

    compressed.free()

    for flat in (False, True):
        s = md.MPIStrategy(device=device, timeout=60, flat_variables=flat, piece_bytes=2048, fusion_bytes=512)

        @check(f"update-{'flat' if flat else 'fused'}")
        def _():
            shapes = [(5, 7), (), (900,), (3,)]
            with s.scope():
                variables = [
                    md.Variable(xp.zeros(shape), aggregation="mean", name=f"w{i}") for i, shape in enumerate(shapes)
                ]
                grads = s.flat_zeros_like(variables)
                for g in grads:
                    g[...] = rank + 1
                s.run(lambda: s.batch_update(zip(variables, grads), "assign_add"))
                s.run(lambda: s.batch_update(zip(variables, grads), lambda w, g: w.__isub__(g * 0.5)))
            for v, shape in zip(variables, shapes):
                component = host(v.component)
                assert component.shape == shape
                assert np.allclose(component, 0.5 * total / size), (v.name, component.ravel()[:3])
            digests = comm.allgather_bytes(b"".join(host(v.component).tobytes() for v in variables), name="w")
            assert len(set(digests)) == 1

        s.free()

    @check("input")
    def _():
        steps = [
            int(host(e.get()))
            for e in strategy.distribute_dataset(range(4 * size + 1), prefetch=0, drop_remainder=True)
        ]
        assert steps == [s * size + rank for s in range(4)], steps
        data = np.arange(8 * size * 3, dtype=np.float32).reshape(8 * size, 3)
        batches = list(strategy.distribute_dataset(md.ArrayDataset(data, global_batch_size=2 * size), prefetch=0))
        per = 2
        for step, batch in enumerate(batches):
            first = step * 2 * size + rank * per
            assert np.array_equal(host(batch.get()), data[first : first + per]), (step, host(batch.get()))

    directory = os.environ.get("MULTINODE_CKPT")
    if directory:

        @check("checkpoint")
        def _():
            elements = 1 << 22  # 32 MiB of float64
            with strategy.scope():
                weights = md.Variable(xp.asarray(np.arange(elements, dtype=np.float64)), name="weights")
                counter = md.Variable(
                    xp.asarray(np.array(0.0)), name="counter", synchronization="on_read", aggregation="sum"
                )
            strategy.run(lambda: counter.assign(xp.asarray(np.array(float(rank + 1)))))  # local in replica context
            with strategy.scope():
                saved = float(host(strategy.read_var(counter)))
            assert saved == total, (saved, total)
            md.Checkpoint(weights=weights, counter=counter).save(directory, fsync=False)
            with strategy.scope():
                weights.assign(xp.zeros(elements))
                counter.assign(xp.asarray(np.array(0.0)))
            before = read_bytes()
            md.Checkpoint(weights=weights, counter=counter).restore(directory)
            report["restore_rchar"] = read_bytes() - before
            report["checkpoint_bytes"] = elements * 8
            assert np.array_equal(host(weights.component), np.arange(elements, dtype=np.float64))
            with strategy.scope():
                restored = float(host(strategy.read_var(counter)))
            assert restored == total, (restored, total)

    strategy.free()


def safety():
    strategy = md.MPIStrategy(timeout=timeout)
    rank, size = strategy.rank, strategy.num_replicas_in_sync
    report.update(rank=rank, size=size)
    last, away = size - 1, (size - 1) // per_node * per_node
    errors = report["errors"] = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = {"type": None}
        except md.MpidistError as exc:
            errors[name] = {
                "type": type(exc).__name__,
                "message": str(exc),
                "missing": list(getattr(exc, "missing_ranks", ()) or ()),
            }
        except Exception as exc:  # the invalid argument itself may surface as a built-in type
            errors[name] = {"type": type(exc).__name__, "message": str(exc), "mpidist": False}

    attempt("mismatch", lambda: strategy.reduce("sum", md.PerReplica({rank: np.zeros(2 + (rank == last))})))
    attempt("bad-argument", lambda: strategy.communicator.allreduce(np.ones(3), "median" if rank == last else "sum"))
    attempt("after", lambda: strategy.communicator.allreduce(np.ones(3)))  # the communicator still works
    started = time.monotonic()
    if rank == away:
        errors["deadline"] = {"type": "stayed away"}
        write(f"rank{rank}.json", report)
        # Stay until the others have reported: a rank that exits closes its connections, and
        # Open MPI's TCP transport may then abort ranks still waiting for it.
        end = time.monotonic() + timeout + 60
        while time.monotonic() < end and len([n for n in os.listdir(out) if n.endswith(".json")]) < size:
            time.sleep(0.1)
        os._exit(0)
    attempt("deadline", strategy.barrier)
    errors["deadline"]["elapsed"] = time.monotonic() - started
    write(f"rank{rank}.json", report)
    os._exit(0)  # the communicator is unusable after a timeout: no MPI_Finalize


def loop():
    strategy = md.MPIStrategy(timeout=timeout)
    rank = strategy.rank
    report.update(rank=rank, size=strategy.num_replicas_in_sync)
    step, started = 0, time.monotonic()
    try:
        while True:
            started = time.monotonic()
            strategy.communicator.allreduce(np.full(1000, 1.0))
            step += 1
            if step == 5:
                write(f"rank{rank}.ready", {"pid": os.getpid(), "host": socket.gethostname()})
            time.sleep(0.02)
    except md.MpidistError as exc:
        report.update(
            error=type(exc).__name__,
            message=str(exc),
            step=step,
            wall=time.time(),
            missing=list(getattr(exc, "missing_ranks", ()) or ()),
            waited=time.monotonic() - started,
        )
        write(f"rank{rank}.json", report)
        if strategy.options.abort_on_error:
            raise
        os._exit(3)


{"basics": basics, "safety": safety, "loop": loop}[scenario]()
if "rank" in report:
    write(f"rank{report['rank']}.json", report)
