"""Benchmarks of mpidist's collectives against raw mpi4py and torch.distributed (gloo), in one run.

Run under the MPI launcher, for example ``mpiexec -n 2 python -m mpidist bench``.
Cases, each measured in the same run against its baselines, variants
interleaved sample by sample so that they see the same machine load:

- ``sweep``: in-place float32 SUM allreduce, 4 B to 256 MiB: raw
  ``Allreduce(IN_PLACE)``, mpidist's communicator (agreement check on and
  off), gloo's ``all_reduce``.
- ``pieces``: mpidist's allreduce of 16, 64 and 256 MiB with different
  ``pipeline_bytes`` (one call: no pieces).
- ``memory``: this machine's memory bandwidth, every rank at once (a copy
  and an add of the largest buffer): the floor the update rows are read against.
- ``update``: a mirrored variable's replica-context MEAN update (8 B to 256 MiB):
  ``assign_add``, ``batch_update`` (also ``in_place=True``), with every check
  off, against the hand loop ``Allreduce(g, tmp); tmp *= 1/N; w += tmp`` and
  the raw ``Allreduce`` alone (and the same loop on gloo); peak memory of the
  update (tracemalloc).
- ``resnet50``: the parameter shapes of ResNet-50 (161 float32 arrays,
  25,557,032 values): one raw in-place call per array, the hand loop per
  array, one raw call on a flat buffer, mpidist's fused ``batch_update``
  (flat variables and gradients, also ``in_place``; ordinary arrays), one
  ``assign_add`` per variable, the SUM of the list (the raw calls' arithmetic) by
  ``strategy.reduce`` (new arrays, ``out=``, and in place: ``out=`` the inputs)
  and ``ReplicaContext.all_reduce`` with ``out=``, gloo per array.
- ``fusion``: the ResNet-50 fused update of ordinary arrays for several
  ``fusion_bytes``.
- ``overlap``: a nonblocking 64 MiB reduction started before a computation
  that makes no MPI call: how much of it is left for ``wait()``.
- ``safety``: an 8-byte allreduce and update with the safety settings off,
  one at a time, and on (the default).
- ``profile``: the 8-byte mirrored update through each layer in turn (the
  agreement alone, the communicator's allreduce, its fused reduce-and-apply,
  ``assign_add``), default settings: where its microseconds go.

Every number is the median over ``--repeats`` samples of the slowest rank's
time; a sample times enough iterations to last about 20 ms. Before the first
round of samples of each measurement and after every round, a probe tells
where the ranks ran: five raw 1 MiB allreduces against five copies of the same
1 MiB within each rank (the slowest rank's medians). On a virtual machine the
hypervisor moves the cores, and when the ranks stop sharing a cache the
allreduce takes several times as long while the local copy does not (see
:func:`~mpidist._tools.bench_report.placements`: the report counts the rounds
of each kind, and ``results.json`` also holds each variant's median over the
rounds in which the ranks shared a cache). Writes
``results.json``, ``results.md`` and ``busbw.png`` (when matplotlib is
installed) to ``--out``: times and ratios, no verdicts. gloo is skipped when
torch is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
import tracemalloc
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from mpidist._comm.library import library_version
from mpidist._comm.reduce_op import ReduceOp
from mpidist._distribute.context import get_replica_context
from mpidist._distribute.strategy import MPIStrategy
from mpidist._distribute.variables import Variable, VariableAggregation
from mpidist._tools.bench_report import placements, write_reports
from mpidist._units import human_time

__all__ = ["DESCRIPTION", "add_arguments", "resnet50_shapes", "run"]

DESCRIPTION = __doc__.split("\n\n")[0]

_MIB = 1 << 20
_SAMPLE_SECONDS = 0.02
_PROBE_CALLS = 5


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of ResNet-50 (torchvision order: conv, then batch-norm scale and shift)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            width, out = planes, planes * 4
            shapes += [(width, inplanes, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


class _Bench:
    """Timing and bookkeeping shared by the cases; collective methods are called by every rank."""

    def __init__(self, repeats: int, torch_dist: Any) -> None:
        self.comm = MPI.COMM_WORLD.Dup()  # the raw baseline's own communicator
        self.rank, self.size = self.comm.rank, self.comm.size
        self.repeats = repeats
        self.dist = torch_dist
        self.results: dict[str, Any] = {}
        self._probe_send = np.ones(_MIB // 4, np.float32)
        self._probe_recv = np.empty_like(self._probe_send)

    def probe(self) -> list[float]:
        """Collective: how the ranks are placed now: seconds of a raw 1 MiB allreduce and of a local 1 MiB copy.

        The slowest rank's median of a few of each.
        """
        times: dict[str, list[float]] = {"allreduce": [], "copy": []}
        for what, call in (("allreduce", lambda: self.comm.Allreduce(self._probe_send, self._probe_recv, MPI.SUM)),
                           ("copy", lambda: np.copyto(self._probe_recv, self._probe_send))):
            for _ in range(_PROBE_CALLS):
                start = time.perf_counter()
                call()
                times[what].append(time.perf_counter() - start)
        slowest = np.empty(2)
        self.comm.Allreduce(np.array([statistics.median(times["allreduce"]), statistics.median(times["copy"])]),
                            slowest, MPI.MAX)
        return slowest.tolist()

    def compare(self, case: str, key: str, variants: dict[str, Callable[[int], None]]) -> dict[str, float]:
        """Collective: time each variant (``fn(iterations)``), samples interleaved; medians in seconds per call.

        Rounds of one sample per variant, with a :meth:`probe` before the first
        round and after each (``probes`` of the entry).
        """
        iterations = {}
        for name, run in variants.items():
            run(1)  # warm up: buffers, lazily created communicators
            self.comm.Barrier()
            start = time.perf_counter()
            run(1)
            once = self.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            iterations[name] = max(1, min(100_000, int(_SAMPLE_SECONDS / max(once, 1e-7))))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        probes = [self.probe()]
        for _ in range(self.repeats):
            for name, run in variants.items():
                self.comm.Barrier()
                start = time.perf_counter()
                run(iterations[name])
                elapsed = self.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                samples[name].append(elapsed / iterations[name])
            probes.append(self.probe())
        medians = {name: statistics.median(s) for name, s in samples.items()}
        entry: dict[str, Any] = {
            name: {"median_s": medians[name], "samples_s": samples[name], "iterations": iterations[name]}
            for name in variants}
        entry["probes"] = probes
        self.results.setdefault(case, {})[key] = entry
        if self.rank == 0:
            shown = ", ".join(f"{name} {human_time(medians[name])}" for name in variants)
            print(f"[bench] {case} {key}: {shown}", flush=True)
        return medians

    def note(self, case: str, key: str, **values: Any) -> None:
        self.results.setdefault(case, {}).setdefault(key, {}).update(values)


def _repeat(fn: Callable[[], Any]) -> Callable[[int], None]:
    def run(iterations: int) -> None:
        for _ in range(iterations):
            fn()
    return run


def _in_replica(strategy: MPIStrategy, fn: Callable[[], Any]) -> Callable[[int], None]:
    """``fn`` repeated inside one ``strategy.run`` (so the timing holds no per-call ``run`` overhead)."""
    loop = _repeat(fn)

    def run(iterations: int) -> None:
        with strategy.scope():
            strategy.run(loop, args=(iterations,))
    return run


def _init_gloo(comm: MPI.Intracomm) -> Any:
    """torch.distributed with the gloo backend over the MPI ranks, or ``None`` (no torch, or it failed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    nodes = comm.allreduce(int(node.rank == 0))
    node.Free()
    host = "127.0.0.1" if nodes == 1 else comm.bcast(socket.gethostname(), root=0)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)
    except (RuntimeError, ValueError) as exc:
        if comm.rank == 0:
            print(f"[bench] gloo unavailable: {exc}", flush=True)
        return None
    return dist


def _sizes(max_bytes: int) -> list[int]:
    sizes, size = [], 4
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def bench_sweep(bench: _Bench, strategies: dict[str, MPIStrategy], max_bytes: int) -> None:
    torch = _torch()
    for nbytes in _sizes(max_bytes):
        buf = np.zeros(nbytes // 4, np.float32)
        variants = {"raw": _repeat(lambda: bench.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)),
                    "mpidist": _repeat(lambda: strategies["check"].communicator.allreduce(buf, "sum", inplace=True))}
        if nbytes <= 64 * 1024:
            variants["mpidist_nocheck"] = _repeat(
                lambda: strategies["nocheck"].communicator.allreduce(buf, "sum", inplace=True))
        if bench.dist is not None:
            tensor = torch.from_numpy(buf)
            variants["gloo"] = _repeat(lambda: bench.dist.all_reduce(tensor))
        bench.compare("sweep", str(nbytes), variants)


def bench_pieces(bench: _Bench, max_bytes: int) -> None:
    pieces = [256 * 1024, _MIB, 2 * _MIB, 4 * _MIB, 8 * _MIB, 16 * _MIB, 1 << 30]
    comms = {p: MPIStrategy(device="cpu", pipeline_bytes=p, check_collectives=False, abort_on_error=False)
             for p in pieces}
    for nbytes in [n for n in (16 * _MIB, 64 * _MIB, 256 * _MIB) if n <= max_bytes]:
        buf = np.zeros(nbytes // 4, np.float32)
        bench.compare("pieces", str(nbytes), {
            ("one_call" if p == 1 << 30 else str(p)): _repeat(
                lambda s=s: s.communicator.allreduce(buf, "sum", inplace=True)) for p, s in comms.items()})
    for s in comms.values():
        s.free()


def _hand_loop(comm: MPI.Intracomm, g: np.ndarray, tmp: np.ndarray, w: np.ndarray) -> Callable[[], None]:
    """The mean update a user writes by hand: ``Allreduce(g, tmp)``, ``tmp *= 1/N``, ``w += tmp`` (``g`` untouched)."""
    scale = 1 / comm.size

    def step() -> None:
        comm.Allreduce(g, tmp, MPI.SUM)
        np.multiply(tmp, scale, out=tmp)
        w.__iadd__(tmp)
    return step


def bench_memory(bench: _Bench, max_bytes: int) -> None:
    """Memory bandwidth of this machine, every rank at once: a copy and an add of ``max_bytes`` arrays."""
    n = max(1, min(max_bytes, 256 * _MIB) // 4)
    a, b = np.ones(n, np.float32), np.zeros(n, np.float32)
    times = bench.compare("memory", str(n * 4), {"copy": _repeat(lambda: np.copyto(b, a)),
                                                  "add": _repeat(lambda: np.add(b, a, out=b))})
    bench.note("memory", str(n * 4), copy_GBps=2 * n * 4 / times["copy"] / 1e9,
               add_GBps=3 * n * 4 / times["add"] / 1e9)


def bench_update(bench: _Bench, strategies: dict[str, MPIStrategy], max_bytes: int) -> None:
    torch = _torch()
    n = bench.size
    for nbytes in [b for b in (8, 4096, _MIB, 4 * _MIB, 16 * _MIB, 64 * _MIB, 256 * _MIB) if b <= max_bytes]:
        grad = np.zeros(nbytes // 4, np.float32)
        tmp = np.zeros_like(grad)
        weight = np.zeros_like(grad)
        with strategies["check"].scope():
            v = Variable(np.zeros_like(grad), aggregation=VariableAggregation.MEAN, name=f"update{nbytes}")
        with strategies["nocheck"].scope():
            w = Variable(np.zeros_like(grad), aggregation=VariableAggregation.MEAN, name=f"update{nbytes}")
        check = strategies["check"]
        variants = {"raw_allreduce": _repeat(lambda: bench.comm.Allreduce(grad, tmp, MPI.SUM)),
                    "hand_loop": _repeat(_hand_loop(bench.comm, grad, tmp, weight)),
                    "mpidist": _in_replica(check, lambda: v.assign_add(grad)),
                    "mpidist_batch_update": _in_replica(check, lambda: check.batch_update([(v, grad)])),
                    "mpidist_in_place": _in_replica(check, lambda: check.batch_update([(v, grad)], in_place=True)),
                    "mpidist_nocheck": _in_replica(strategies["nocheck"], lambda: w.assign_add(grad))}
        if bench.dist is not None:
            tensor, target = torch.from_numpy(tmp), torch.from_numpy(weight)

            def gloo_hand_loop() -> None:
                bench.dist.all_reduce(tensor)
                tensor.div_(n)
                target.add_(tensor)
            variants["gloo_hand_loop"] = _repeat(gloo_hand_loop)
        bench.compare("update", str(nbytes), variants)
        bench.note("update", str(nbytes), peak_extra_bytes=_peak_growth(check, v, grad),
                   pipeline_bytes=check.options.pipeline_bytes)


def bench_safety(bench: _Bench) -> None:
    """Per-call cost of the safety settings: an 8-byte allreduce and an 8-byte mirrored MEAN update."""
    settings = {"all_off": dict(check_collectives=False, timeout=None), "check_only": dict(timeout=None),
                "deadline_only": dict(check_collectives=False), "default": {}}
    strategies = {name: MPIStrategy(device="cpu", abort_on_error=False, **kw) for name, kw in settings.items()}
    x, out = np.ones(1), np.empty(1)
    variants = {"raw": _repeat(lambda: bench.comm.Allreduce(x, out, MPI.SUM))}
    variants.update({name: _repeat(lambda s=s: s.communicator.allreduce(x, out=out)) for name, s in strategies.items()})
    bench.compare("safety", "allreduce_8B", variants)
    tmp, weight = np.empty(1), np.zeros(1)
    updates = {"hand_loop": _repeat(_hand_loop(bench.comm, x, tmp, weight))}
    for name, s in strategies.items():
        with s.scope():
            v = Variable(np.zeros(1), aggregation=VariableAggregation.MEAN, name="safety")
        updates[name] = _in_replica(s, lambda v=v: v.assign_add(x))
    bench.compare("safety", "update_8B", updates)
    for s in strategies.values():
        s.free()


def bench_profile(bench: _Bench, strategy: MPIStrategy) -> None:
    """Where the time of an 8-byte mirrored MEAN update goes: the same update through each layer, default settings."""
    comm = strategy.communicator
    x, out, tmp, weight = np.ones(1), np.empty(1), np.empty(1), np.zeros(1)
    with strategy.scope():
        v = Variable(np.zeros(1), aggregation=VariableAggregation.MEAN, name="profile")
    add = lambda target, reduced: target.__iadd__(reduced)  # noqa: E731
    bench.compare("profile", "update_8B", {
        "raw_allreduce": _repeat(lambda: bench.comm.Allreduce(x, out, MPI.SUM)),
        "hand_loop": _repeat(_hand_loop(bench.comm, x, tmp, weight)),
        "agreement": _repeat(comm.barrier),
        "communicator_allreduce": _repeat(lambda: comm.allreduce(x, "mean", out=out)),
        "communicator_reduce_apply": _repeat(lambda: comm.reduce_apply((x,), (weight,), (ReduceOp.MEAN,), add,
                                                                        ("profile",))),
        "assign_add": _in_replica(strategy, lambda: v.assign_add(x)),
    })


def _peak_growth(strategy: MPIStrategy, v: Any, grad: np.ndarray) -> int:
    """Collective: the most memory (traced allocations) one update allocates beyond what it started with."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with strategy.scope():
            strategy.run(lambda: v.assign_add(grad))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return int(strategy.communicator.mpi_comm.allreduce(peak - before, op=MPI.MAX))


def bench_resnet(bench: _Bench, strategies: dict[str, MPIStrategy]) -> None:
    torch = _torch()
    shapes = resnet50_shapes()
    raw_grads = [np.zeros(s, np.float32) for s in shapes]
    raw_tmps = [np.zeros(s, np.float32) for s in shapes]
    raw_weights = [np.zeros(s, np.float32) for s in shapes]
    hand_loops = [_hand_loop(bench.comm, g, t, w) for g, t, w in zip(raw_grads, raw_tmps, raw_weights)]
    flat = np.zeros(sum(int(np.prod(s)) for s in shapes), np.float32)
    check, flat_strategy = strategies["check"], strategies["flat"]
    with flat_strategy.scope():
        flat_vars = [Variable(np.zeros(s, np.float32), aggregation=VariableAggregation.MEAN, name=f"flat{i}")
                     for i, s in enumerate(shapes)]
    flat_grads = flat_strategy.flat_zeros_like(flat_vars)
    with check.scope():
        plain_vars = [Variable(np.zeros(s, np.float32), aggregation=VariableAggregation.MEAN, name=f"plain{i}")
                      for i, s in enumerate(shapes)]
    plain_grads = [np.zeros(s, np.float32) for s in shapes]
    reduced = [np.empty_like(g) for g in plain_grads]

    def per_variable() -> None:
        for v, g in zip(plain_vars, plain_grads):
            v.assign_add(g)

    variants = {
        "raw_per_array": _repeat(lambda: [bench.comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM) for g in raw_grads]),
        "hand_loop_per_array": _repeat(lambda: [step() for step in hand_loops]),
        "raw_flat_one_call": _repeat(lambda: bench.comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)),
        "mpidist_batch_update_flat": _in_replica(flat_strategy, lambda: flat_strategy.batch_update(
            zip(flat_vars, flat_grads))),
        "mpidist_batch_update_flat_in_place": _in_replica(flat_strategy, lambda: flat_strategy.batch_update(
            zip(flat_vars, flat_grads), in_place=True)),
        "mpidist_batch_update": _in_replica(check, lambda: check.batch_update(zip(plain_vars, plain_grads))),
        "mpidist_per_variable": _in_replica(check, per_variable),
        "mpidist_reduce_list": _repeat(lambda: check.reduce("sum", plain_grads)),
        "mpidist_reduce_list_out": _repeat(lambda: check.reduce("sum", plain_grads, out=reduced)),
        "mpidist_all_reduce_out": _in_replica(check, lambda: get_replica_context().all_reduce(
            "sum", plain_grads, out=reduced)),
        "mpidist_reduce_list_in_place": _repeat(lambda: check.reduce("sum", raw_grads, out=raw_grads)),
    }
    if bench.dist is not None:
        tensors = [torch.from_numpy(g) for g in raw_grads]
        variants["gloo_per_array"] = _repeat(lambda: [bench.dist.all_reduce(t) for t in tensors])
    bench.compare("resnet50", "161 arrays", variants)
    bench.note("resnet50", "161 arrays", arrays=len(shapes), values=int(flat.size))


def bench_fusion(bench: _Bench) -> None:
    shapes = resnet50_shapes()
    grads = [np.zeros(s, np.float32) for s in shapes]
    variants = {}
    strategies = []
    for limit in (0, 64 * 1024, 256 * 1024, _MIB, 4 * _MIB):
        s = MPIStrategy(device="cpu", fusion_bytes=limit, abort_on_error=False)
        with s.scope():
            vs = [Variable(np.zeros(sh, np.float32), aggregation=VariableAggregation.MEAN) for sh in shapes]
        variants[str(limit)] = _in_replica(s, lambda s=s, vs=vs: s.batch_update(zip(vs, grads)))
        strategies.append(s)
    bench.compare("fusion", "resnet50 arrays", variants)
    for s in strategies:
        s.free()


def bench_overlap(bench: _Bench, strategy: MPIStrategy, max_bytes: int) -> None:
    nbytes = min(64 * _MIB, max_bytes)
    buf = np.zeros(nbytes // 4, np.float32)
    comm = strategy.communicator
    blocking = bench.compare("overlap", str(nbytes), {"blocking": _repeat(lambda: comm.allreduce(buf, inplace=True))})
    spin = blocking["blocking"]
    waits = []
    for _ in range(bench.repeats):
        bench.comm.Barrier()
        handle = comm.iallreduce(buf, inplace=True)
        until = time.perf_counter() + spin
        while time.perf_counter() < until:  # computation that makes no MPI call
            pass
        start = time.perf_counter()
        handle.wait()
        waits.append(bench.comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    bench.note("overlap", str(nbytes), wait_after_compute_s=statistics.median(waits),
               left_for_wait=statistics.median(waits) / spin)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--out", default="bench-results", help="directory for results.json, results.md, busbw.png")
    parser.add_argument("--repeats", type=int, default=7, help="samples per measurement (median reported)")
    parser.add_argument("--max-bytes", type=int, default=256 * _MIB, help="largest buffer (default 256 MiB)")
    parser.add_argument("--cases", default="sweep,pieces,memory,update,resnet50,fusion,overlap,safety,profile",
                        help="comma-separated subset of the cases")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.distributed (gloo) baseline")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed arguments (see :func:`add_arguments`). Collective: run it under mpiexec."""
    cases = set(args.cases.split(","))
    bench = _Bench(args.repeats, None if args.no_torch else _init_gloo(MPI.COMM_WORLD))
    strategies = {"check": MPIStrategy(device="cpu", abort_on_error=False),
                  "nocheck": MPIStrategy(device="cpu", check_collectives=False, timeout=None, abort_on_error=False),
                  "flat": MPIStrategy(device="cpu", flat_variables=True, abort_on_error=False)}
    started = time.time()
    if "sweep" in cases:
        bench_sweep(bench, strategies, args.max_bytes)
    if "pieces" in cases:
        bench_pieces(bench, args.max_bytes)
    if "memory" in cases:
        bench_memory(bench, args.max_bytes)
    if "update" in cases:
        bench_update(bench, strategies, args.max_bytes)
    if "resnet50" in cases:
        bench_resnet(bench, strategies)
    if "fusion" in cases:
        bench_fusion(bench)
    if "overlap" in cases:
        bench_overlap(bench, strategies["nocheck"], args.max_bytes)
    if "safety" in cases:
        bench_safety(bench)
    if "profile" in cases:
        bench_profile(bench, strategies["check"])
    meta = {"ranks": bench.size, "mpi": library_version(),
            "python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(time.time() - started, 1), "repeats": args.repeats,
            "pipeline_bytes": strategies["check"].options.pipeline_bytes,
            "fusion_bytes": strategies["check"].options.fusion_bytes,
            "torch": getattr(_torch(), "__version__", None) if bench.dist is not None else None}
    for s in strategies.values():
        s.free()
    if bench.dist is not None:
        bench.dist.destroy_process_group()
    if bench.rank == 0:
        placements(bench.results)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "results": bench.results}, f, indent=1)
        for path in write_reports(meta, bench.results, args.out):
            print(f"[bench] wrote {path}", flush=True)
    bench.comm.Free()
    return 0
