"""How the state of a reduction's inputs changes its time: the ResNet-50 ``strategy.reduce(out=)``, interleaved.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/input_state.py --rounds 25

The same call, ``strategy.reduce("sum", grads, out=out)`` of ResNet-50's 161 float32 gradients (97.5 MiB),
and its baseline, one raw in-place ``Allreduce`` per array, with their inputs in different states. Each
sample is one call timed alone (a barrier, the call; the slowest rank's time), every variant once per
round, rounds repeated; the script prints each variant's median and the median over rounds of its ratio
to ``rewritten`` (the state a training step leaves, which ``python -m mpidist bench`` now measures), so
that the load on a shared machine cancels.

- ``zero_page``: ``np.zeros`` never written, what the benchmark reduced before: every page is the kernel's
  zero page, so reading the inputs costs almost nothing.
- ``zero_page_heap``: the same, allocated as in the benchmark's process, where earlier cases had freed
  large arrays: glibc then raises its mmap threshold (to the size of the largest freed block, up to
  32 MiB) and takes arrays below it from the heap. The script frees a 16 MiB array to get there, after
  making the other variants' arrays.
- ``written_once``: written when made, never again (real memory; what the caches hold is what the
  previous call left).
- ``rewritten``: new values written before every call, as a backward pass does.
- ``rewritten_heap``: the same, allocated from the heap.
- ``new_arrays``: a new list of gradients every step (as a backward pass that returns new arrays).
- ``out_per_call``: the ``out=`` arrays allocated before every call (MPI writes into new pages).
- ``raw``, ``raw_not_rewritten``: the baseline on rewritten inputs, and as the benchmark ran it before
  (in place on the same arrays, never rewritten).

Under Open MPI, set ``OMPI_MCA_coll_libnbc_iallreduce_algorithm=1`` to measure with the setting that
``python -m mpidist bench`` runs with (this script, like most, imports mpi4py before mpidist: see
``benchmarks/user_script.py``); the script prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist._tools.bench import mpi_settings, resnet50_shapes

comm = MPI.COMM_WORLD
rank = comm.rank
_steps = [0]


def write(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """New values, rank- and step-dependent, into every array (a backward pass)."""
    _steps[0] += 1
    value = 1.0 + rank + (_steps[0] % 64) / 64
    for a in arrays:
        a[...] = value
    return arrays


def free_a_large_array() -> None:
    """Allocate and free 16 MiB, as the benchmark's earlier cases did: glibc raises its mmap threshold to it."""
    large = np.ones(16 << 18, np.float32)
    del large


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds of samples (one call per variant each)")
    parser.add_argument("--shrink", type=int, default=1, help="divide the first dimension of every shape by this")
    args = parser.parse_args(argv)
    shapes = [(max(1, s[0] // args.shrink), *s[1:]) for s in resnet50_shapes()]
    strategy = mpidist.MPIStrategy(device="cpu")

    def zeros() -> list[np.ndarray]:
        return [np.zeros(s, np.float32) for s in shapes]

    sets = {
        "zero_page": zeros(),
        "written_once": write(zeros()),
        "rewritten": zeros(),
        "raw": zeros(),
        "raw_not_rewritten": [np.zeros_like(a) for a in zeros()],
    }  # zeros_like writes: real pages, sums stay 0
    outs = {name: [np.full(s, 0.5, np.float32) for s in shapes] for name in sets}
    free_a_large_array()  # from here on, arrays of up to 16 MiB come from the heap
    for name in ("zero_page_heap", "rewritten_heap"):
        sets[name] = zeros()
        outs[name] = [np.full(s, 0.5, np.float32) for s in shapes]
    state: dict[str, Any] = {}

    def reduce(name: str) -> Callable[[], Any]:
        return lambda: strategy.reduce("sum", sets[name], out=outs[name])

    def raw(name: str) -> Callable[[], Any]:
        return lambda: [comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM) for a in sets[name]]

    def nothing() -> None:
        pass

    variants: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {  # (untimed preparation, timed call)
        "zero_page": (nothing, reduce("zero_page")),
        "zero_page_heap": (nothing, reduce("zero_page_heap")),
        "written_once": (nothing, reduce("written_once")),
        "rewritten": (lambda: write(sets["rewritten"]), reduce("rewritten")),
        "rewritten_heap": (lambda: write(sets["rewritten_heap"]), reduce("rewritten_heap")),
        "new_arrays": (
            lambda: state.update(g=write([np.empty(s, np.float32) for s in shapes])),
            lambda: strategy.reduce("sum", state["g"], out=outs["rewritten"]),
        ),
        "out_per_call": (
            lambda: state.update(out=[np.empty(s, np.float32) for s in shapes], g=write(sets["rewritten"])),
            lambda: strategy.reduce("sum", state["g"], out=state["out"]),
        ),
        "raw": (lambda: write(sets["raw"]), raw("raw")),
        "raw_not_rewritten": (nothing, raw("raw_not_rewritten")),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for prepare, call in variants.values():  # warm up
        for _ in range(2):
            prepare()
            call()
            state.clear()
    for _ in range(args.rounds):
        for name, (prepare, call) in variants.items():
            prepare()
            comm.Barrier()
            start = time.perf_counter()
            call()
            times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            state.clear()
    if rank == 0:
        mpi = " ".join(MPI.Get_library_version().splitlines()[0].split())
        settings = ", ".join(f"{name}={value}" for name, value in mpi_settings().items())
        mib = sum(int(np.prod(s)) for s in shapes) * 4 / (1 << 20)
        print(
            f"{comm.size} ranks, {mpi}; {len(shapes)} arrays, {mib:.1f} MiB; {args.rounds} rounds; "
            f"MPI settings: {settings}\n"
        )
        print("| inputs | median | vs rewritten (median of the rounds' ratios) | quartiles |\n|---|---|---|---|")
        for name, ts in times.items():
            ratios = [t / r for t, r in zip(ts, times["rewritten"])]
            q = statistics.quantiles(ratios, n=4)
            print(
                f"| {name} | {statistics.median(ts) * 1e3:.2f} ms | {statistics.median(ratios):.2f} | "
                f"{q[0]:.2f}-{q[2]:.2f} |"
            )
    strategy.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
