"""Checkpoint save/restore throughput against numpy.save/numpy.load of the same bytes.

Run it once per number of ranks, e.g.::

    mpiexec -n 1 python benchmarks/checkpoint_bench.py
    mpiexec -n 2 python benchmarks/checkpoint_bench.py

The model is a set of mirrored float32 variables (default 8 x 32 MiB = 256 MiB).
The baseline is one process (rank 0, while the others wait) writing the same
arrays with ``numpy.save`` into one ``.npy`` file each, without and with an
``fsync`` per file (mpidist fsyncs by default), and reading them back with
``numpy.load``. For restore, a second baseline is what every rank would do on its
own to get verified data: ``numpy.load`` of every array plus ``zlib.crc32`` of the
bytes it read, on every rank at once ("every rank loads"): the ratio of mpidist's restore (which
verifies every byte) to it is the headline restore figure. A Checkpoint keeps the buffer its
restore read into for its next restore, so the repeated restores measure a rollback through
one Checkpoint; "restore, new Checkpoint" measures a restore through a new one each time (the
first restore of a job, which allocates that buffer). mpidist's times are those of the
collective call (all ranks start together after a barrier; the slowest rank counts). Each measurement is
repeated and the median reported; baseline and mpidist runs alternate so both
see the same machine load. Ratios are mpidist time / baseline time: below 1
is faster than NumPy.

Put ``--dir`` on the file system you care about (a shared one for several
nodes); the default is the system's temporary directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist._checkpoint.checkpoint import Checkpoint


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="total size of the variables in MiB (default 256)")
    parser.add_argument("--variables", type=int, default=8, help="number of mirrored variables (default 8)")
    parser.add_argument("--repeat", type=int, default=5, help="measurements per operation; the median is kept")
    parser.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    parser.add_argument("--markdown", action="store_true", help="print one Markdown table row")
    return parser.parse_args()


def timed(strategy, fn) -> float:
    """Wall time of a collective ``fn``: barrier, run, the slowest rank's time."""
    strategy.barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return float(strategy.comm.allreduce(elapsed, op=MPI.MAX))


def numpy_save(arrays: dict, directory: Path, fsync: bool) -> None:
    for name, array in arrays.items():
        with open(directory / f"{name}.npy", "wb") as f:
            np.save(f, array)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def numpy_load(arrays: dict, directory: Path) -> None:
    for name in arrays:
        np.load(directory / f"{name}.npy", allow_pickle=False)


def numpy_load_all_crc(arrays: dict, directory: Path) -> None:
    for name in arrays:
        zlib.crc32(np.load(directory / f"{name}.npy", allow_pickle=False))


def main() -> None:
    args = parse()
    strategy = mpidist.MPIStrategy(device="cpu")
    rank, size = strategy.rank, strategy.num_replicas_in_sync
    root = Path(strategy.comm.bcast(tempfile.mkdtemp(prefix="mpidist-bench-", dir=args.dir) if rank == 0 else None))
    elements = (args.mib << 20) // 4 // args.variables
    rng = np.random.default_rng(0)
    with strategy.scope():
        variables = {
            f"layer{i}": mpidist.Variable(lambda: rng.standard_normal(elements, dtype=np.float32), name=f"layer{i}")
            for i in range(args.variables)
        }
    arrays = {name: np.asarray(v.values[0]) for name, v in variables.items()}
    nbytes = sum(a.nbytes for a in arrays.values())
    checkpoint = Checkpoint(**variables)
    baseline = root / "numpy"
    if rank == 0:
        baseline.mkdir()

    def on_rank0(fn):
        return lambda: fn() if rank == 0 else None

    results: dict[str, list[float]] = {
        k: []
        for k in (
            "np_save",
            "np_save_fsync",
            "np_load",
            "save",
            "save_nofsync",
            "restore",
            "restore_new",
            "crc32",
            "np_load_all",
        )
    }
    for _ in range(args.repeat):
        results["np_save"].append(timed(strategy, on_rank0(lambda: numpy_save(arrays, baseline, False))))
        results["save_nofsync"].append(timed(strategy, lambda: checkpoint.save(root / "ckpt", fsync=False)))
        results["np_save_fsync"].append(timed(strategy, on_rank0(lambda: numpy_save(arrays, baseline, True))))
        results["save"].append(timed(strategy, lambda: checkpoint.save(root / "ckpt")))
        results["np_load"].append(timed(strategy, on_rank0(lambda: numpy_load(arrays, baseline))))
        results["restore"].append(timed(strategy, lambda: checkpoint.restore(root / "ckpt")))
        results["np_load_all"].append(timed(strategy, lambda: numpy_load_all_crc(arrays, baseline)))
        results["restore_new"].append(timed(strategy, lambda: Checkpoint(**variables).restore(root / "ckpt")))
        results["crc32"].append(timed(strategy, on_rank0(lambda: [zlib.crc32(a) for a in arrays.values()])))
    med = {k: statistics.median(v) for k, v in results.items()}
    if rank == 0:
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        if args.markdown:
            print(
                f"| {size} | {nbytes >> 20} MiB | {med['np_save']:.3f} | {med['save_nofsync']:.3f} | "
                f"{med['save_nofsync'] / med['np_save']:.2f} | {med['np_save_fsync']:.3f} | {med['save']:.3f} | "
                f"{med['save'] / med['np_save_fsync']:.2f} | {med['np_load']:.3f} | {med['restore']:.3f} | "
                f"{med['restore'] / med['np_load']:.2f} | {med['crc32']:.3f} | {med['np_load_all']:.3f} | "
                f"{med['restore'] / med['np_load_all']:.2f} |"
            )
        else:
            print(
                f"{size} rank(s), {args.variables} mirrored float32 variables, {nbytes >> 20} MiB, "
                f"median of {args.repeat}, directory {root}"
            )
            for label, ours, theirs in (
                ("save, no fsync", "save_nofsync", "np_save"),
                ("save, fsync", "save", "np_save_fsync"),
                ("restore", "restore", "np_load"),
                ("restore", "restore", "np_load_all"),
                ("restore, new Checkpoint", "restore_new", "np_load_all"),
            ):
                print(
                    f"  {label:23s} mpidist {med[ours]:.3f} s ({gbs(med[ours]):.2f} GB/s)   numpy "
                    f"{med[theirs]:.3f} s ({gbs(med[theirs]):.2f} GB/s)   ratio {med[ours] / med[theirs]:.2f}"
                )
            print(
                "  (first restore line: against numpy.load on rank 0 alone; the other two: against every rank "
                "loading every array and CRC-32 of its bytes)"
            )
            print(
                f"  restore with verification / every rank numpy.load + CRC-32: "
                f"{med['restore'] / med['np_load_all']:.2f} (new Checkpoint each time: "
                f"{med['restore_new'] / med['np_load_all']:.2f})"
            )
            print(f"  for scale: CRC-32 of the same bytes in one thread takes {med['crc32']:.3f} s")
    strategy.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    strategy.free()


if __name__ == "__main__":
    main()
