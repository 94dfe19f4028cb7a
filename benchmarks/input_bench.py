"""Per-step cost of mpidist's distributed array dataset against plain local slicing of the same rows.

    mpiexec -n N python benchmarks/input_bench.py [--batch 64] [--features 784] [--steps 400]

Each rank reads a per-rank batch of ``--batch`` rows of ``--features`` float32
(plus int64 labels) per step, from a dataset of ``--epoch-steps`` global
batches. The baseline slices the very same rows locally (``x[order[lo:hi]]``
when shuffled, a view ``x[lo:hi]`` when not), with the same index arithmetic
precomputed, so the difference is the dataset's own overhead: the iterator,
the ``PerReplica`` wrapping, the prefetch thread hand-off (prefetch 0, 2, and the
default the rank chooses from its cores). "+step" rows add a
small training-like step to both loops (an MLP forward pass,
``tanh(batch @ w1) @ w2`` with ``--hidden`` units), during which the prefetch
thread gathers the next batch.

Prints one markdown table row per case: median over ``--repeats`` runs of the
slowest rank's seconds per step, and its ratios against local slicing and
against the same case with ``prefetch=0``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpidist._distribute.strategy import MPIStrategy
from mpidist._input.datasets import ArrayDataset
from mpidist._input.factories import distribute_dataset
from mpidist._input.prefetch import default_depth
from mpidist._input.sharding import batch_rows, epoch_order


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="rows per rank and step")
    p.add_argument("--features", type=int, default=784)
    p.add_argument("--epoch-steps", type=int, default=200, help="global batches in the dataset")
    p.add_argument("--steps", type=int, default=200, help="steps timed per run (at most --epoch-steps)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--hidden", type=int, default=256, help="hidden units of the step's MLP")
    return p.parse_args()


def main() -> None:
    args = parse()
    strategy = MPIStrategy()
    comm, rank, size = MPI.COMM_WORLD, strategy.rank, strategy.num_replicas_in_sync
    global_batch = args.batch * size
    num = global_batch * args.epoch_steps
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num, args.features), dtype=np.float32)
    y = rng.integers(0, 10, num)
    w1 = rng.standard_normal((args.features, args.hidden), dtype=np.float32) / args.features**0.5
    w2 = rng.standard_normal((args.hidden, 10), dtype=np.float32)
    steps = min(args.steps, args.epoch_steps)

    def compute(batch: np.ndarray) -> None:
        np.tanh(batch @ w1) @ w2

    def baseline(shuffle: bool, work: bool) -> float:
        order = epoch_order(num, 0, 0, shuffle)
        bounds = [batch_rows(s * global_batch, num, global_batch, rank, size) for s in range(steps)]
        start = time.perf_counter()
        for lo, hi in bounds:
            if shuffle:
                index = order[lo:hi]
                batch = (x[index], y[index])
            else:
                batch = (x[lo:hi], y[lo:hi])
            if work:
                compute(batch[0])
        return time.perf_counter() - start

    def distributed(shuffle: bool, work: bool, prefetch: int | None, per_transfer: int) -> float:
        dist = distribute_dataset(
            strategy,
            ArrayDataset((x, y), global_batch, shuffle=shuffle),
            prefetch=prefetch,
            steps_per_transfer=per_transfer,
        )
        it = iter(dist)
        start = time.perf_counter()
        for _, (xb, _labels) in zip(range(steps), it):
            if work:
                compute(xb.get())
        elapsed = time.perf_counter() - start
        it.close()
        return elapsed

    def slowest(fn, *a) -> float:
        comm.Barrier()
        return comm.allreduce(fn(*a), op=MPI.MAX) / steps

    if rank == 0:
        print(
            f"ranks {size}, {args.batch} rows x {args.features} float32 per rank and step, {steps} steps, "
            f"median of {args.repeats}"
        )
        print(
            "| case | prefetch | steps per transfer | local slicing (us/step) | distributed (us/step) "
            "| overhead (us/step) | vs local slicing | vs prefetch 0 |"
        )
        print("|---|---|---|---|---|---|---|---|")
    groups = [(shuffle, work, (0, 2, None), 1) for shuffle in (True, False) for work in (False, True)]
    groups.append((True, False, (0, 2), 8))
    for shuffle, work, prefetches, per_transfer in groups:
        base: list[float] = []
        dist: dict = {prefetch: [] for prefetch in prefetches}
        for _ in range(args.repeats):  # the baseline and every prefetch depth interleaved, so drifts hit all alike
            base.append(slowest(baseline, shuffle, work))
            for prefetch in prefetches:
                dist[prefetch].append(slowest(distributed, shuffle, work, prefetch, per_transfer))
        b = statistics.median(base)
        unprefetched = statistics.median(dist[0])
        for prefetch in prefetches:
            d = statistics.median(dist[prefetch])
            if rank == 0:
                case = ("shuffled" if shuffle else "in order (views)") + (" +step" if work else "")
                default = default_depth(
                    strategy.communicator.backend, strategy.communicator.local_size, views=not shuffle
                )
                shown = f"default ({default})" if prefetch is None else prefetch
                print(
                    f"| {case} | {shown} | {per_transfer} | {b * 1e6:.1f} | {d * 1e6:.1f} | {(d - b) * 1e6:+.1f} "
                    f"| {d / b:.2f} | {d / unprefetched:.2f} |",
                    flush=True,
                )
    strategy.free()


if __name__ == "__main__":
    main()
