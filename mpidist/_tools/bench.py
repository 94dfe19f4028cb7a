"""Benchmarks of mpidist's collectives against raw mpi4py and torch.distributed (gloo), in one run.

Run under the MPI launcher, for example ``mpiexec -n 2 python -m mpidist bench``.
Cases, each measured in the same run against its baselines, variants
interleaved sample by sample so that they see the same machine load:

- ``sweep``: in-place float32 SUM allreduce, 4 B to 256 MiB: raw
  ``Allreduce(IN_PLACE)``, mpidist's communicator (agreement check on and
  off), gloo's ``all_reduce``.
- ``pieces``: mpidist's allreduce of 16, 64 and 256 MiB with different
  ``piece_bytes`` (one call: no pieces).
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
- ``timeline``: an 8-byte allreduce and an 8-byte mirrored update with
  ``options.timeline`` off and on (every rank recording its collectives into a
  temporary directory): what the timeline costs per collective.
- ``profile``: the 8-byte mirrored update through each layer in turn (the
  agreement alone, the communicator's allreduce, its fused reduce-and-apply,
  ``assign_add``), default settings: where its microseconds go.
- ``alltoall``: ``comm.alltoall(rows, splits)`` of float32 rows, 8 B and
  1 KiB to 64 MiB per rank, with even splits (``splits=None``) against one
  raw ``Alltoall``, and with uneven splits (each rank its own) against the
  raw ``Alltoall`` of the counts followed by ``Alltoallv``; the raw calls
  allocate their receive buffer in the call, as mpidist allocates its
  result; mpidist with every check off up to 64 KiB.
- ``bfloat16``: the in-place SUM allreduce of bfloat16 arrays (``ml_dtypes``)
  beside float32 arrays of as many elements, 1 KiB to 64 MiB of float32, and
  the raw float32 ``Allreduce``; skipped, with a note in the results, where
  ``ml_dtypes`` is missing or the communicator refuses bfloat16.
- ``compression``: a mirrored variable's replica-context MEAN update
  (``assign_add``) of 1, 16 and 64 MiB of float32 by a strategy with
  ``compression="fp16"`` and one with ``"bf16"``, against the same update
  by the default (exact) strategy: what wire compression costs or saves on
  this machine's links (on one node, memory).
- ``scaling``: the agreement's cost against the number of ranks, counted: for
  an 8-byte mirrored MEAN update (the agreement carries the data), an in-place
  1 MiB float32 allreduce (the agreement, then the reduction) and a barrier,
  each by mpidist (default settings) and by raw mpi4py (the hand loop, one
  ``Allreduce``, ``Barrier``): the MPI calls made per collective, and the
  point-to-point messages and bytes each rank's MPI library sends for them,
  its collective algorithms' own messages included
  (:mod:`~mpidist._tools.bench_counts`). Counts do not depend on timing, so
  they hold with more ranks than cores. The library's messages are counted
  under Open MPI started with its monitoring on
  (``OMPI_MCA_pml_monitoring_enable=1 mpiexec -n N python -m mpidist bench
  --cases scaling``); MPICH has no such counters. With at most one rank per
  core the same calls are also timed, against raw mpi4py; with more, the ranks
  take turns on the cores and timings would measure that, so they are not
  taken. ``benchmarks/agreement_scaling.py`` runs the case at several numbers
  of ranks and writes one table.

Inputs are as a training step leaves them. Before every timed call, mpidist's
and the baselines' alike, the arrays a step writes (gradients, the buffers of
the sweep) are written with new values that depend on the rank and on the
call, as a backward pass would write them (:class:`Gradients`); memory that is
only read or updated (weights, variables, scratch buffers) is written once when
it is made. No input is a never-written ``np.zeros``: the kernel maps those to
its zero page, which reads as free, so reductions of them would look cheaper
than they are in a real training step.

Each call is timed alone, as a user's script times it: the write (not timed),
a barrier, then the call; a call's time is that of the slowest rank. A sample
is the mean of enough such calls to last about 20 ms; every number is the
median over ``--repeats`` samples. Before the first round of samples of each
measurement and after every round, a probe tells where the ranks ran: five raw
1 MiB allreduces against five copies of the same 1 MiB within each rank (the
slowest rank's medians). On a virtual machine the hypervisor moves the cores,
and when the ranks stop sharing a cache the allreduce takes several times as
long while the local copy does not (see
:func:`~mpidist._tools.bench_report.placements`: the report counts the rounds
of each kind, and ``results.json`` also holds each variant's median over the
rounds in which the ranks shared a cache). Writes ``results.json``,
``results.md`` and ``busbw.png`` (when matplotlib is installed) to ``--out``:
times and ratios, no verdicts. gloo is skipped when torch is missing.
``benchmarks/user_script.py`` makes the same calls as a user's script does and
compares them with this benchmark's timing of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.library import PerformanceVariables, library_version
from mpidist._comm.reduce_op import ReduceOp
from mpidist._comm.tuning import libnbc_iallreduce_algorithm
from mpidist._distribute.context import get_replica_context
from mpidist._distribute.strategy import MPIStrategy
from mpidist._distribute.variables import MirroredVariable, Variable, VariableAggregation
from mpidist._tools.bench_counts import MESSAGES, CallCounter, library_counters
from mpidist._tools.bench_report import placements, write_reports
from mpidist._tools.cli import positive_int
from mpidist._units import human_time

__all__ = [
    "CASES",
    "DEFAULT_CASES",
    "DESCRIPTION",
    "INPUTS",
    "MPI_SETTINGS",
    "Bench",
    "Gradients",
    "Variant",
    "add_arguments",
    "alltoall_variants",
    "bfloat16_variants",
    "compression_variants",
    "make_strategies",
    "mpi_settings",
    "resnet50_shapes",
    "resnet_variants",
    "run",
    "sample",
    "scaling_variants",
    "uneven_splits",
    "update_variants",
]

DESCRIPTION = __doc__.split("\n\n")[0]

_MIB = 1 << 20
_SAMPLE_SECONDS = 0.02
_MAX_CALLS = 100_000  # calls in one sample at most
_PROBE_CALLS = 5
_COUNTED_CALLS = 10  # calls of a collective whose MPI calls and messages are counted (after two that are not)
_WEIGHT = 0.5  # the value weights and scratch buffers are written with once, when they are made
# How the inputs were made, as results.json records it ("inputs" of "meta"; runs before it lack the key and read
# never-written gradients).
INPUTS = "written before each call, each call timed alone"
# The cases --cases may name; those of a plain run.
DEFAULT_CASES = (
    "sweep",
    "pieces",
    "memory",
    "update",
    "resnet50",
    "fusion",
    "overlap",
    "safety",
    "timeline",
    "profile",
    "alltoall",
    "bfloat16",
)
CASES = (*DEFAULT_CASES, "compression", "scaling")
# MPI settings that change the results and depend on how the job started, recorded in "meta": Open MPI's algorithm for
# the nonblocking allreduce that mpidist's pieces run on. mpidist sets it when imported before mpi4py.MPI (as
# `python -m mpidist` is); a script that imports mpi4py.MPI first runs with Open MPI's own choice.
MPI_SETTINGS = ("OMPI_MCA_coll_libnbc_iallreduce_algorithm",)


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of ResNet-50 (torchvision order: conv, then batch-norm scale and shift)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            width, out = planes, planes * 4
            shapes += [
                (width, inplanes, 1, 1),
                (width,),
                (width,),
                (width, width, 3, 3),
                (width,),
                (width,),
                (out, width, 1, 1),
                (out,),
                (out,),
            ]
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


def _nothing() -> None:
    """The write of a variant whose inputs no training step writes."""


@dataclasses.dataclass
class Variant:
    """One way of making a call: ``call()`` is timed; ``write()`` runs before each call, untimed.

    ``write`` writes what a training step writes before such a call (the
    gradients: see :class:`Gradients`). With ``strategy``, the samples run in
    that strategy's replica context (inside one ``strategy.run``, whose own
    cost is not timed).
    """

    call: Callable[[], Any]
    write: Callable[[], None] = _nothing
    strategy: Optional[MPIStrategy] = None


class Gradients:
    """Local: writes arrays as a training step's backward pass does, before every call.

    Each write fills every element of every array with a new value that
    depends on the rank and on the number of the write (bounded, so that sums
    stay small and exact). So no page of a gradient is the kernel's zero page,
    which reads as free, and the caches hold what a backward pass leaves in
    them: the last arrays written.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self.writes = 0  # how many writes so far, all writers together

    def value(self) -> float:
        """Local: the value of the next write (and count it)."""
        self.writes += 1
        return 1.0 + self._rank + (self.writes % 64) / 64

    def writer(self, arrays: Sequence[Any]) -> Callable[[], None]:
        """Local: a function that writes new values into every one of ``arrays`` (NumPy arrays or torch tensors)."""
        arrays = list(arrays)

        def write() -> None:
            value = self.value()
            for a in arrays:
                a.fill(value)

        return write


def mpi_settings() -> dict[str, Optional[str]]:
    """Local: the values of :data:`MPI_SETTINGS` in this process's environment (``None``: not set)."""
    return {name: os.environ.get(name) for name in MPI_SETTINGS}


def _weights(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """Memory that is only read or updated in place (weights, scratch buffers): real pages, written once now."""
    return np.full(shape, _WEIGHT, dtype)


def _mirrored(initial: np.ndarray, name: Optional[str] = None) -> MirroredVariable:
    """Collective, in a strategy's scope: a mirrored MEAN variable that starts as ``initial``."""
    v = Variable(initial, name=name, aggregation=VariableAggregation.MEAN)
    assert isinstance(v, MirroredVariable)
    return v


def _in_place_allreduce(strategy: MPIStrategy, buf: np.ndarray) -> Callable[[], Any]:
    """The call of the sweep and pieces cases: the strategy's communicator reduces ``buf`` in place."""
    return lambda: strategy.communicator.allreduce(buf, "sum", inplace=True)


def _all_reduce_into(reduced: list[np.ndarray], grads: list[np.ndarray]) -> Callable[[], Any]:
    """``ReplicaContext.all_reduce`` of ``grads`` into ``reduced`` (call it in replica context)."""

    def call() -> Any:
        context = get_replica_context()
        assert context is not None, "called outside strategy.run"
        return context.all_reduce("sum", grads, out=reduced)

    return call


def sample(comm: MPI.Intracomm, variant: Variant, calls: int) -> float:
    """Collective over ``comm``: seconds per call of ``calls`` calls of ``variant``, each timed alone.

    Before each call: ``variant.write()``, then a barrier; only the call is
    timed. A call's time is the slowest rank's; the result is their mean. A
    variant with a strategy runs in its replica context, where an update is
    reduced.
    """
    times = np.empty(calls)
    write, call, barrier, clock = variant.write, variant.call, comm.Barrier, time.perf_counter

    def loop() -> None:
        for i in range(calls):
            write()
            barrier()
            start = clock()
            call()
            times[i] = clock() - start

    if variant.strategy is None:
        loop()
    else:
        with variant.strategy.scope():
            variant.strategy.run(loop)
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return float(times.mean())


class Bench:
    """Timing and bookkeeping shared by the cases; collective methods are called by every rank."""

    def __init__(self, repeats: int, torch_dist: Any) -> None:
        self.comm = MPI.COMM_WORLD.Dup()  # the raw baseline's own communicator
        self.rank, self.size = self.comm.rank, self.comm.size
        self.repeats = repeats
        self.dist = torch_dist
        self.gradients = Gradients(self.rank)
        self.results: dict[str, Any] = {}
        self._probe_send = _weights(_MIB // 4)
        self._probe_recv = _weights(_MIB // 4)

    def probe(self) -> list[float]:
        """Collective: how the ranks are placed now: seconds of a raw 1 MiB allreduce and of a local 1 MiB copy.

        The slowest rank's median of a few of each.
        """
        times: dict[str, list[float]] = {"allreduce": [], "copy": []}
        for what, call in (
            ("allreduce", lambda: self.comm.Allreduce(self._probe_send, self._probe_recv, MPI.SUM)),
            ("copy", lambda: np.copyto(self._probe_recv, self._probe_send)),
        ):
            for _ in range(_PROBE_CALLS):
                start = time.perf_counter()
                call()
                times[what].append(time.perf_counter() - start)
        slowest = np.empty(2)
        self.comm.Allreduce(
            np.array([statistics.median(times["allreduce"]), statistics.median(times["copy"])]), slowest, MPI.MAX
        )
        return slowest.tolist()

    def sample(self, variant: Variant, calls: int) -> float:
        """Collective: :func:`sample` over this benchmark's communicator."""
        return sample(self.comm, variant, calls)

    def compare(self, case: str, key: str, variants: dict[str, Variant]) -> dict[str, float]:
        """Collective: time each variant, samples interleaved; medians in seconds per call.

        Rounds of one sample per variant, with a :meth:`probe` before the first
        round and after each (``probes`` of the entry).
        """
        calls = {}
        for name, variant in variants.items():
            self.sample(variant, 1)  # warm up: buffers, lazily created communicators
            start = time.perf_counter()
            self.sample(variant, 1)
            once = self.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)  # the write and barrier too
            calls[name] = max(1, min(_MAX_CALLS, int(_SAMPLE_SECONDS / max(once, 1e-7))))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        probes = [self.probe()]
        for _ in range(self.repeats):
            for name, variant in variants.items():
                samples[name].append(self.sample(variant, calls[name]))
            probes.append(self.probe())
        medians = {name: statistics.median(s) for name, s in samples.items()}
        entry: dict[str, Any] = {
            name: {"median_s": medians[name], "samples_s": samples[name], "iterations": calls[name]}
            for name in variants
        }
        entry["probes"] = probes
        self.results.setdefault(case, {})[key] = entry
        if self.rank == 0:
            shown = ", ".join(f"{name} {human_time(medians[name])}" for name in variants)
            print(f"[bench] {case} {key}: {shown}", flush=True)
        return medians

    def note(self, case: str, key: str, **values: Any) -> None:
        """Local: add ``values`` to the results entry of ``case`` and ``key``."""
        self.results.setdefault(case, {}).setdefault(key, {}).update(values)

    def count(self, variant: Variant, calls: CallCounter, library: Optional[PerformanceVariables]) -> dict[str, Any]:
        """Collective: what one call of ``variant`` costs, counted over calls made back to back.

        Two calls first, not counted (lazily made plans and buffers); then
        ``_COUNTED_CALLS`` calls, each after its write, with nothing between
        them (a barrier's messages would count). Returns, per call: ``mpi_calls``,
        the MPI calls ``calls`` counted on rank 0 by method name (``mpi_calls_alike``:
        every rank made the same); with ``library``, per rank the point-to-point
        messages and bytes it sent (``messages``, ``bytes``) and the bytes it
        received (``received_bytes``), else ``None`` for those.
        """
        made: dict[str, float] = {}
        window: list[dict[str, list[int]]] = []
        write, call = variant.write, variant.call

        def loop() -> None:
            for _ in range(2):
                write()
                call()
            calls.counts.clear()
            if library is not None:
                window.append(library.read())
            for _ in range(_COUNTED_CALLS):
                write()
                call()
            if library is not None:
                window.append(library.read())
            made.update({name: n / _COUNTED_CALLS for name, n in sorted(calls.counts.items())})

        if variant.strategy is None:
            loop()
        else:
            with variant.strategy.scope():
                variant.strategy.run(loop)
        sent: Optional[list[list[float]]] = None  # per call, to each rank: messages, then bytes
        if window:
            before, after = window
            sent = [[(a - b) / _COUNTED_CALLS for a, b in zip(after[name], before[name])] for name in MESSAGES]
        everyone = self.comm.allgather((made, sent))
        entry: dict[str, Any] = {
            "mpi_calls": made,
            "mpi_calls_alike": all(m == made for m, _ in everyone),
            "messages": None,
            "bytes": None,
            "received_bytes": None,
        }
        if all(s is not None for _, s in everyone):  # the same library and settings on every rank: all or none
            sizes = [s[1] for _, s in everyone]
            entry["messages"] = [sum(s[0]) for _, s in everyone]
            entry["bytes"] = [sum(row) for row in sizes]
            entry["received_bytes"] = [sum(row[r] for row in sizes) for r in range(self.size)]
        return entry


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


def bench_sweep(bench: Bench, strategies: dict[str, MPIStrategy], max_bytes: int) -> None:
    torch = _torch()
    for nbytes in _sizes(max_bytes):
        buf = np.empty(nbytes // 4, np.float32)
        write = bench.gradients.writer([buf])
        variants = {
            "raw": Variant(lambda: bench.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), write),
            "mpidist": Variant(_in_place_allreduce(strategies["check"], buf), write),
        }
        if nbytes <= 64 * 1024:
            variants["mpidist_nocheck"] = Variant(_in_place_allreduce(strategies["nocheck"], buf), write)
        if bench.dist is not None:
            tensor = torch.from_numpy(buf)
            variants["gloo"] = Variant(lambda: bench.dist.all_reduce(tensor), write)
        bench.compare("sweep", str(nbytes), variants)


def bench_pieces(bench: Bench, max_bytes: int) -> None:
    pieces = [256 * 1024, _MIB, 2 * _MIB, 4 * _MIB, 8 * _MIB, 16 * _MIB, 1 << 30]
    comms = {p: MPIStrategy(device="cpu", piece_bytes=p, check_collectives=False, abort_on_error=False) for p in pieces}
    for nbytes in [n for n in (16 * _MIB, 64 * _MIB, 256 * _MIB) if n <= max_bytes]:
        buf = np.empty(nbytes // 4, np.float32)
        write = bench.gradients.writer([buf])
        bench.compare(
            "pieces",
            str(nbytes),
            {
                ("one_call" if p == 1 << 30 else str(p)): Variant(_in_place_allreduce(s, buf), write)
                for p, s in comms.items()
            },
        )
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


def bench_memory(bench: Bench, max_bytes: int) -> None:
    """Memory bandwidth of this machine, every rank at once: a copy and an add of ``max_bytes`` arrays."""
    n = max(1, min(max_bytes, 256 * _MIB) // 4)
    a, b = _weights(n), _weights(n)
    times = bench.compare(
        "memory", str(n * 4), {"copy": Variant(lambda: np.copyto(b, a)), "add": Variant(lambda: np.add(b, a, out=b))}
    )
    bench.note("memory", str(n * 4), copy_GBps=2 * n * 4 / times["copy"] / 1e9, add_GBps=3 * n * 4 / times["add"] / 1e9)


def make_strategies() -> dict[str, MPIStrategy]:
    """Collective: the strategies the cases share: ``check`` (the defaults), ``nocheck`` (every check off), ``flat``.

    ``flat`` has ``flat_variables``. None of them aborts the job on an error.
    """
    return {
        "check": MPIStrategy(device="cpu", abort_on_error=False),
        "nocheck": MPIStrategy(device="cpu", check_collectives=False, timeout=None, abort_on_error=False),
        "flat": MPIStrategy(device="cpu", flat_variables=True, abort_on_error=False),
    }


def update_variants(bench: Bench, strategies: dict[str, MPIStrategy], nbytes: int) -> dict[str, Variant]:
    """Collective (it makes variables): the variants of the ``update`` case for float32 gradients of ``nbytes``."""
    grad = np.empty(nbytes // 4, np.float32)
    write = bench.gradients.writer([grad])
    tmp, weight = _weights(grad.shape), _weights(grad.shape)
    check, nocheck = strategies["check"], strategies["nocheck"]
    with check.scope():
        v = _mirrored(_weights(grad.shape), f"update{nbytes}")
    with nocheck.scope():
        w = _mirrored(_weights(grad.shape), f"update{nbytes}")
    variants = {
        "raw_allreduce": Variant(lambda: bench.comm.Allreduce(grad, tmp, MPI.SUM), write),
        "hand_loop": Variant(_hand_loop(bench.comm, grad, tmp, weight), write),
        "mpidist": Variant(lambda: v.assign_add(grad), write, check),
        "mpidist_batch_update": Variant(lambda: check.batch_update([(v, grad)]), write, check),
        "mpidist_in_place": Variant(lambda: check.batch_update([(v, grad)], in_place=True), write, check),
        "mpidist_nocheck": Variant(lambda: w.assign_add(grad), write, nocheck),
    }
    torch = _torch()
    if bench.dist is not None:
        n = bench.size
        gloo_grad, gloo_weight = torch.from_numpy(np.empty_like(grad)), torch.from_numpy(_weights(grad.shape))

        def gloo_hand_loop() -> None:
            bench.dist.all_reduce(gloo_grad)
            gloo_grad.div_(n)
            gloo_weight.add_(gloo_grad)

        variants["gloo_hand_loop"] = Variant(gloo_hand_loop, bench.gradients.writer([gloo_grad]))
    return variants


def bench_update(bench: Bench, strategies: dict[str, MPIStrategy], max_bytes: int) -> None:
    for nbytes in [b for b in (8, 4096, _MIB, 4 * _MIB, 16 * _MIB, 64 * _MIB, 256 * _MIB) if b <= max_bytes]:
        variants = update_variants(bench, strategies, nbytes)
        bench.compare("update", str(nbytes), variants)
        bench.note(
            "update",
            str(nbytes),
            peak_extra_bytes=_peak_growth(bench, variants["mpidist"]),
            piece_bytes=strategies["check"].options.piece_bytes,
        )


def bench_safety(bench: Bench) -> None:
    """Per-call cost of the safety settings: an 8-byte allreduce and an 8-byte mirrored MEAN update."""
    settings: dict[str, dict[str, Any]] = {
        "all_off": dict(check_collectives=False, timeout=None),
        "check_only": dict(timeout=None),
        "deadline_only": dict(check_collectives=False),
        "default": {},
    }
    _compare_8_bytes(
        bench,
        "safety",
        {name: MPIStrategy(device="cpu", abort_on_error=False, **kw) for name, kw in settings.items()},
        baselines=True,
    )


def bench_timeline(bench: Bench) -> None:
    """Per-call cost of the timeline: an 8-byte allreduce and an 8-byte mirrored MEAN update, recorded or not."""
    directory = tempfile.mkdtemp(prefix="mpidist-bench-timeline-")  # each rank its own: each writes its own file
    strategies = {
        "off": MPIStrategy(device="cpu", abort_on_error=False),
        "on": MPIStrategy(device="cpu", abort_on_error=False, timeline=directory),
    }
    _compare_8_bytes(bench, "timeline", strategies, baselines=False)
    shutil.rmtree(directory, ignore_errors=True)  # the file stays open, unlinked, until exit


def _compare_8_bytes(bench: Bench, case: str, strategies: dict[str, MPIStrategy], baselines: bool) -> None:
    """Collective: ``case``'s ``allreduce_8B`` (the communicator's allreduce into ``out=``) and ``update_8B`` (a
    mirrored MEAN ``assign_add``) of one float64 by each strategy, with raw mpi4py's ``Allreduce`` and the hand
    loop beside them when ``baselines``; the strategies are freed at the end."""
    x, out = np.empty(1), _weights(1, np.float64)
    write = bench.gradients.writer([x])
    variants = {"raw": Variant(lambda: bench.comm.Allreduce(x, out, MPI.SUM), write)} if baselines else {}
    for name, s in strategies.items():
        variants[name] = Variant(functools.partial(s.communicator.allreduce, x, out=out), write)
    bench.compare(case, "allreduce_8B", variants)
    updates = {}
    if baselines:
        tmp, weight = _weights(1, np.float64), _weights(1, np.float64)
        updates["hand_loop"] = Variant(_hand_loop(bench.comm, x, tmp, weight), write)
    for name, s in strategies.items():
        with s.scope():
            v = _mirrored(_weights(1, np.float64), case)
        updates[name] = Variant(functools.partial(v.assign_add, x), write, s)
    bench.compare(case, "update_8B", updates)
    for s in strategies.values():
        s.free()


_ALLTOALL_SIZES = (8, *(1024 * 4**k for k in range(9)))  # bytes per rank: 8 B, then 1 KiB to 64 MiB


def uneven_splits(rows: int, rank: int, size: int) -> list[int]:
    """Local: ``rows`` split over ``size`` ranks unevenly, and differently on each ``rank``.

    Rank ``j`` gets a share weighted ``1 + (rank + j) % size`` (rounded down;
    the last rank also takes what the rounding leaves), so every rank sends
    and receives unequal counts.
    """
    weights = [1 + (rank + j) % size for j in range(size)]
    splits = [rows * w // sum(weights) for w in weights]
    splits[-1] += rows - sum(splits)
    return splits


def _raw_alltoall(comm: MPI.Intracomm, send: np.ndarray) -> Callable[[], Any]:
    """Even splits by hand: one ``Alltoall`` into a receive buffer allocated in the call."""

    def call() -> Any:
        recv = np.empty_like(send)
        comm.Alltoall(send, recv)
        return recv

    return call


def _raw_alltoallv(comm: MPI.Intracomm, send: np.ndarray, splits: list[int]) -> Callable[[], Any]:
    """Uneven splits by hand: the counts by ``Alltoall``, then the rows by ``Alltoallv`` into a buffer allocated in
    the call."""
    send_counts = np.array(splits, np.int32)
    send_displs = np.zeros_like(send_counts)
    np.cumsum(send_counts[:-1], out=send_displs[1:])
    recv_counts, recv_displs = np.empty_like(send_counts), np.zeros_like(send_counts)
    datatype = MPI.Datatype.fromcode(send.dtype.char)

    def call() -> Any:
        comm.Alltoall(send_counts, recv_counts)
        np.cumsum(recv_counts[:-1], out=recv_displs[1:])
        recv = np.empty(int(recv_counts.sum()), send.dtype)
        comm.Alltoallv([send, (send_counts, send_displs), datatype], [recv, (recv_counts, recv_displs), datatype])
        return recv, recv_counts

    return call


def alltoall_variants(
    bench: Bench, strategies: dict[str, MPIStrategy], nbytes: int, even: bool
) -> tuple[dict[str, Variant], int]:
    """Local: the variants of the ``alltoall`` case for float32 rows of about ``nbytes`` per rank, and their bytes.

    The rows are ``nbytes / 4`` rounded down to a multiple of the number of
    ranks (at least one per rank), written before every call.
    """
    rows = max(bench.size, nbytes // 4 // bench.size * bench.size)
    send = np.empty(rows, np.float32)
    write = bench.gradients.writer([send])
    splits = None if even else uneven_splits(rows, bench.rank, bench.size)
    raw = _raw_alltoall(bench.comm, send) if splits is None else _raw_alltoallv(bench.comm, send, splits)
    variants = {
        "raw": Variant(raw, write),
        "mpidist": Variant(functools.partial(strategies["check"].communicator.alltoall, send, splits), write),
    }
    if nbytes <= 64 * 1024:
        variants["mpidist_nocheck"] = Variant(
            functools.partial(strategies["nocheck"].communicator.alltoall, send, splits), write
        )
    return variants, send.nbytes


def bench_alltoall(bench: Bench, strategies: dict[str, MPIStrategy], max_bytes: int) -> None:
    for nbytes in [b for b in _ALLTOALL_SIZES if b <= max_bytes]:
        for splits in ("even", "uneven"):
            variants, sent = alltoall_variants(bench, strategies, nbytes, splits == "even")
            bench.compare("alltoall", f"{nbytes} {splits}", variants)
            bench.note("alltoall", f"{nbytes} {splits}", bytes=sent)


def _bfloat16() -> Any:
    """``ml_dtypes.bfloat16``, or ``None`` without ``ml_dtypes``."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


def bfloat16_variants(bench: Bench, strategy: MPIStrategy, nbytes: int, bfloat16: Any) -> dict[str, Variant]:
    """Local: the variants of the ``bfloat16`` case: in-place SUM allreduces of ``nbytes / 4`` elements."""
    single, half = np.empty(nbytes // 4, np.float32), np.empty(nbytes // 4, bfloat16)
    write_single, write_half = bench.gradients.writer([single]), bench.gradients.writer([half])
    return {
        "raw_float32": Variant(lambda: bench.comm.Allreduce(MPI.IN_PLACE, single, MPI.SUM), write_single),
        "float32": Variant(_in_place_allreduce(strategy, single), write_single),
        "bfloat16": Variant(_in_place_allreduce(strategy, half), write_half),
    }


def bench_bfloat16(bench: Bench, strategy: MPIStrategy, max_bytes: int) -> None:
    bfloat16, skipped = _bfloat16(), None
    if bfloat16 is None:
        skipped = "ml_dtypes is not installed"
    else:
        try:  # every rank alike: the same dtype, the same version of mpidist
            strategy.communicator.allreduce(np.ones(2, bfloat16), inplace=True, name="bfloat16 probe")
        except (TypeError, ValueError) as exc:
            skipped = f"the communicator refused bfloat16 ({type(exc).__name__}: {exc})"
    if skipped is not None:
        bench.note("bfloat16", "skipped", reason=skipped)
        if bench.rank == 0:
            print(f"[bench] bfloat16 skipped: {skipped}", flush=True)
        return
    for nbytes in [b for b in _ALLTOALL_SIZES[1:] if b <= max_bytes]:
        bench.compare("bfloat16", str(nbytes), bfloat16_variants(bench, strategy, nbytes, bfloat16))


COMPRESSION_SIZES = (_MIB, 16 * _MIB, 64 * _MIB)  # the float32 gradients of the compression case


def compression_variants(bench: Bench, strategies: dict[str, MPIStrategy], nbytes: int) -> dict[str, Variant]:
    """Collective (it makes variables): the ``compression`` case's variants: the MEAN update of ``nbytes`` of
    float32 by each strategy of ``strategies`` (``exact``, ``fp16``, ``bf16``), from one gradient array."""
    grad = np.empty(nbytes // 4, np.float32)
    write = bench.gradients.writer([grad])
    variants = {}
    for name, strategy in strategies.items():
        with strategy.scope():
            v = _mirrored(_weights(grad.shape), f"compression{nbytes}")
        variants[name] = Variant(functools.partial(v.assign_add, grad), write, strategy)
    return variants


def bench_compression(bench: Bench, max_bytes: int) -> None:
    strategies = {
        "exact": MPIStrategy(device="cpu", abort_on_error=False),
        "fp16": MPIStrategy(device="cpu", compression="fp16", abort_on_error=False),
        "bf16": MPIStrategy(device="cpu", compression="bf16", abort_on_error=False),
    }
    for nbytes in [b for b in COMPRESSION_SIZES if b <= max_bytes]:
        bench.compare("compression", str(nbytes), compression_variants(bench, strategies, nbytes))
    for s in strategies.values():
        s.free()


def scaling_variants(bench: Bench, strategy: MPIStrategy, comm: MPI.Intracomm) -> dict[str, dict[str, Variant]]:
    """Collective (it makes a variable): the collectives of the ``scaling`` case, by raw mpi4py on ``comm`` and by
    mpidist's ``strategy``.

    ``update_8B``: a mirrored MEAN update of two float32 (``assign_add`` in
    replica context; the hand loop); ``allreduce_1MiB``: an in-place float32
    SUM of 1 MiB (the communicator's ``allreduce``; one raw ``Allreduce``);
    ``barrier``.
    """
    grad, buf = np.empty(2, np.float32), np.empty(_MIB // 4, np.float32)
    write_grad, write_buf = bench.gradients.writer([grad]), bench.gradients.writer([buf])
    with strategy.scope():
        v = _mirrored(_weights(2), "scaling")
    return {
        "update_8B": {
            "raw": Variant(_hand_loop(comm, grad, _weights(2), _weights(2)), write_grad),
            "mpidist": Variant(lambda: v.assign_add(grad), write_grad, strategy),
        },
        "allreduce_1MiB": {
            "raw": Variant(lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), write_buf),
            "mpidist": Variant(_in_place_allreduce(strategy, buf), write_buf),
        },
        "barrier": {"raw": Variant(comm.Barrier), "mpidist": Variant(strategy.communicator.barrier)},
    }


def bench_scaling(bench: Bench, strategy: MPIStrategy) -> None:
    """The agreement's cost against the number of ranks: counted at any number of ranks, timed at one rank per core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = strategy.communicator.local_size
    for key, variants in scaling_variants(bench, strategy, bench.comm).items():
        if ranks <= cores:
            bench.compare("scaling", key, variants)
        else:
            bench.note("scaling", key, not_timed=f"{ranks} ranks on {cores} cores: timings would measure their turns")
    library, counted_by = library_counters()
    calls = CallCounter()
    try:
        with calls.installed(strategy.communicator):
            for key, variants in scaling_variants(bench, strategy, calls.wrap(bench.comm)).items():
                counts = {name: bench.count(variant, calls, library) for name, variant in variants.items()}
                bench.note("scaling", key, counts=counts, counted_by=counted_by, counted_calls=_COUNTED_CALLS)
    finally:
        if library is not None:
            library.free()
    if bench.rank == 0:
        print(f"[bench] scaling: MPI calls counted; {counted_by}", flush=True)


def bench_profile(bench: Bench, strategy: MPIStrategy) -> None:
    """Where the time of an 8-byte mirrored MEAN update goes: the same update through each layer, default settings."""
    comm = strategy.communicator
    x = np.empty(1)
    out, tmp, weight = _weights(1, np.float64), _weights(1, np.float64), _weights(1, np.float64)
    write = bench.gradients.writer([x])
    with strategy.scope():
        v = _mirrored(_weights(1, np.float64), "profile")
    add = lambda target, reduced: target.__iadd__(reduced)  # noqa: E731
    bench.compare(
        "profile",
        "update_8B",
        {
            "raw_allreduce": Variant(lambda: bench.comm.Allreduce(x, out, MPI.SUM), write),
            "hand_loop": Variant(_hand_loop(bench.comm, x, tmp, weight), write),
            "agreement": Variant(comm.barrier, write),
            "communicator_allreduce": Variant(lambda: comm.allreduce(x, "mean", out=out), write),
            "communicator_reduce_apply": Variant(
                lambda: comm.reduce_apply((x,), (weight,), (ReduceOp.MEAN,), add, ("profile",)), write
            ),
            "assign_add": Variant(lambda: v.assign_add(x), write, strategy),
        },
    )


def _peak_growth(bench: Bench, variant: Variant) -> int:
    """Collective: the most memory (traced allocations) one call of ``variant`` allocates beyond its start."""
    peak = [0]

    def traced() -> None:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            variant.call()
            peak[0] = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()

    bench.sample(Variant(traced, variant.write, variant.strategy), 1)
    return int(bench.comm.allreduce(peak[0], op=MPI.MAX))


def resnet_variants(
    bench: Bench, strategies: dict[str, MPIStrategy], shapes: Optional[Sequence[tuple[int, ...]]] = None
) -> dict[str, Variant]:
    """Collective (it makes variables): the variants of the ``resnet50`` case (``shapes``: ResNet-50's by default)."""
    torch = _torch()
    shapes = resnet50_shapes() if shapes is None else list(shapes)
    grads = bench.gradients
    raw_grads = [np.empty(s, np.float32) for s in shapes]
    hand_grads = [np.empty(s, np.float32) for s in shapes]
    hand_loops = [_hand_loop(bench.comm, g, _weights(s), _weights(s)) for g, s in zip(hand_grads, shapes)]
    flat = np.empty(sum(int(np.prod(s)) for s in shapes), np.float32)
    check, flat_strategy = strategies["check"], strategies["flat"]
    with flat_strategy.scope():
        flat_vars = [_mirrored(_weights(s), f"flat{i}") for i, s in enumerate(shapes)]
    flat_grads = flat_strategy.flat_zeros_like(flat_vars)
    with check.scope():
        plain_vars = [_mirrored(_weights(s), f"plain{i}") for i, s in enumerate(shapes)]
    plain_grads = [np.empty(s, np.float32) for s in shapes]
    reduced = [_weights(s) for s in shapes]
    write_raw, write_plain, write_flat = grads.writer(raw_grads), grads.writer(plain_grads), grads.writer(flat_grads)

    def per_variable() -> None:
        for v, g in zip(plain_vars, plain_grads):
            v.assign_add(g)

    def raw_per_array() -> None:
        for g in raw_grads:
            bench.comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM)

    def raw_per_array_out() -> None:  # what out= asks of MPI: the inputs kept, the sums in other arrays
        for g, r in zip(raw_grads, reduced):
            bench.comm.Allreduce(g, r, MPI.SUM)

    def hand_loop_per_array() -> None:
        for step in hand_loops:
            step()

    variants = {
        "raw_per_array": Variant(raw_per_array, write_raw),
        "raw_per_array_out": Variant(raw_per_array_out, write_raw),
        "hand_loop_per_array": Variant(hand_loop_per_array, grads.writer(hand_grads)),
        "raw_flat_one_call": Variant(lambda: bench.comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM), grads.writer([flat])),
        "mpidist_batch_update_flat": Variant(
            lambda: flat_strategy.batch_update(zip(flat_vars, flat_grads)), write_flat, flat_strategy
        ),
        "mpidist_batch_update_flat_in_place": Variant(
            lambda: flat_strategy.batch_update(zip(flat_vars, flat_grads), in_place=True), write_flat, flat_strategy
        ),
        "mpidist_batch_update": Variant(lambda: check.batch_update(zip(plain_vars, plain_grads)), write_plain, check),
        "mpidist_per_variable": Variant(per_variable, write_plain, check),
        "mpidist_reduce_list": Variant(lambda: check.reduce("sum", plain_grads), write_plain),
        "mpidist_reduce_list_out": Variant(lambda: check.reduce("sum", plain_grads, out=reduced), write_plain),
        "mpidist_all_reduce_out": Variant(_all_reduce_into(reduced, plain_grads), write_plain, check),
        "mpidist_reduce_list_in_place": Variant(lambda: check.reduce("sum", raw_grads, out=raw_grads), write_raw),
    }
    if bench.dist is not None:
        tensors = [torch.from_numpy(g) for g in raw_grads]

        def gloo_per_array() -> None:
            for t in tensors:
                bench.dist.all_reduce(t)

        variants["gloo_per_array"] = Variant(gloo_per_array, write_raw)
    return variants


def bench_resnet(bench: Bench, strategies: dict[str, MPIStrategy]) -> None:
    shapes = resnet50_shapes()
    bench.compare("resnet50", "161 arrays", resnet_variants(bench, strategies, shapes))
    bench.note("resnet50", "161 arrays", arrays=len(shapes), values=sum(int(np.prod(s)) for s in shapes))


def bench_fusion(bench: Bench) -> None:
    shapes = resnet50_shapes()
    grads = [np.empty(s, np.float32) for s in shapes]
    write = bench.gradients.writer(grads)
    variants = {}
    strategies = []
    for limit in (0, 64 * 1024, 256 * 1024, _MIB, 4 * _MIB):
        s = MPIStrategy(device="cpu", fusion_bytes=limit, abort_on_error=False)
        with s.scope():
            vs = [_mirrored(_weights(sh)) for sh in shapes]
        variants[str(limit)] = Variant(functools.partial(s.batch_update, list(zip(vs, grads))), write, s)
        strategies.append(s)
    bench.compare("fusion", "resnet50 arrays", variants)
    for s in strategies:
        s.free()


def bench_overlap(bench: Bench, strategy: MPIStrategy, max_bytes: int) -> None:
    nbytes = min(64 * _MIB, max_bytes)
    buf = np.empty(nbytes // 4, np.float32)
    write = bench.gradients.writer([buf])
    comm = strategy.communicator
    blocking = bench.compare(
        "overlap", str(nbytes), {"blocking": Variant(lambda: comm.allreduce(buf, inplace=True), write)}
    )
    spin = blocking["blocking"]
    waits = []
    for _ in range(bench.repeats):
        write()
        bench.comm.Barrier()
        handle = comm.iallreduce(buf, inplace=True)
        until = time.perf_counter() + spin
        while time.perf_counter() < until:  # computation that makes no MPI call
            pass
        start = time.perf_counter()
        handle.wait()
        waits.append(bench.comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    bench.note(
        "overlap",
        str(nbytes),
        wait_after_compute_s=statistics.median(waits),
        left_for_wait=statistics.median(waits) / spin,
    )


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cases(text: str) -> set[str]:
    """An argparse ``type``: the comma-separated cases of ``--cases``, each one of :data:`CASES`."""
    cases = {case.strip() for case in text.split(",") if case.strip()}
    unknown = sorted(cases - set(CASES))
    if not cases or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown case{'s' if len(unknown) != 1 else ''} {', '.join(map(repr, unknown))}; "
            f"choose from {','.join(CASES)}"
            if unknown
            else "it names no case"
        )
    return cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--out", default="bench-results", help="directory for results.json, results.md, busbw.png")
    parser.add_argument(
        "--repeats", type=positive_int, default=7, help="samples per measurement (median reported; default 7)"
    )
    parser.add_argument("--max-bytes", type=positive_int, default=256 * _MIB, help="largest buffer (default 256 MiB)")
    parser.add_argument(
        "--cases",
        type=_cases,
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated subset of the cases (default {','.join(DEFAULT_CASES)}); "
        "also 'compression' (not in the default list: it runs best "
        "across nodes) and 'scaling' (not in the default list): the MPI calls of "
        "mpidist's agreement and, under Open MPI started with OMPI_MCA_pml_monitoring_enable=1, the messages and "
        "bytes each rank's MPI library sends for them, counted at any number of ranks, also more ranks than cores "
        "(OMPI_MCA_pml_monitoring_enable=1 mpiexec --oversubscribe -n 16 python -m mpidist bench --cases scaling); "
        "timed too where each rank has a core; benchmarks/agreement_scaling.py runs it at N = 2, 4, 8, 16 and "
        "writes one table",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.distributed (gloo) baseline")


def _unwritable(out: str) -> Optional[str]:
    """Local: why the results cannot be written into directory ``out`` (made if missing), or ``None``."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if os.access(out, os.W_OK | os.X_OK) else "permission denied"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed arguments (see :func:`add_arguments`). Collective: run it under mpiexec."""
    cases = args.cases
    unwritable = _unwritable(args.out) if MPI.COMM_WORLD.rank == 0 else None
    unwritable = MPI.COMM_WORLD.bcast(unwritable)
    if unwritable is not None:  # found before the hours of measuring, on every rank
        if MPI.COMM_WORLD.rank == 0:
            print(f"mpidist bench: error: cannot write the results to --out {args.out}: {unwritable}", file=sys.stderr)
        return 1
    bench = Bench(args.repeats, None if args.no_torch else _init_gloo(MPI.COMM_WORLD))
    strategies = make_strategies()
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
    if "timeline" in cases:
        bench_timeline(bench)
    if "profile" in cases:
        bench_profile(bench, strategies["check"])
    if "alltoall" in cases:
        bench_alltoall(bench, strategies, args.max_bytes)
    if "bfloat16" in cases:
        bench_bfloat16(bench, strategies["check"], args.max_bytes)
    if "compression" in cases:
        bench_compression(bench, args.max_bytes)
    if "scaling" in cases:
        bench_scaling(bench, strategies["check"])
    meta = {
        "ranks": bench.size,
        "mpi": library_version(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.time() - started, 1),
        "repeats": args.repeats,
        "inputs": INPUTS,
        "mpi_settings": mpi_settings(),
        "libnbc_iallreduce_algorithm": libnbc_iallreduce_algorithm(),
        "piece_bytes": strategies["check"].options.piece_bytes,
        "fusion_bytes": strategies["check"].options.fusion_bytes,
        "torch": getattr(_torch(), "__version__", None) if bench.dist is not None else None,
    }
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
