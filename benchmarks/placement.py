"""Where the ranks run, over time: the benchmark's placement probe, and optionally the cores' round trip.

    mpiexec -n 2 python benchmarks/placement.py --samples 40
    cc -O2 -pthread benchmarks/core_to_core.c -o core_to_core
    mpiexec -n 2 python benchmarks/placement.py --core-to-core ./core_to_core

Every ``--every`` seconds: the probe of ``python -m mpidist bench`` (five raw
1 MiB allreduces against five copies of 1 MiB within a rank, the slowest
rank's medians, and how many copies the allreduce took), then, with ``--core-to-core``,
rank 0 runs that program (a cache line bounced between CPU 0 and CPU 1) while
the other ranks sleep. One line per sample on rank 0. On a virtual machine the
two go up and down together when the hypervisor moves the cores apart and back
(docs/benchmarks.md, "Placement of the ranks").
"""

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20, help="how many samples (default 20)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("--core-to-core", metavar="PROGRAM", help="benchmarks/core_to_core.c, built")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    send = np.ones(1 << 18, np.float32)
    recv = np.empty_like(send)
    for _ in range(args.samples):
        comm.Barrier()
        medians = []
        for call in (lambda: comm.Allreduce(send, recv, MPI.SUM), lambda: np.copyto(recv, send)):
            times = []
            for _ in range(5):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        allreduce, copy = (comm.allreduce(t, op=MPI.MAX) for t in medians)
        if comm.rank == 0:
            line = (
                f"{time.strftime('%H:%M:%S')} allreduce {allreduce * 1e6:6.0f} us, copy {copy * 1e6:4.0f} us: "
                f"{allreduce / copy:5.1f} copies"
            )
            if args.core_to_core:
                ns = subprocess.run([args.core_to_core], capture_output=True, text=True, check=True).stdout.strip()
                line += f"   core-to-core round trip {ns} ns"
            print(line, flush=True)
        else:
            time.sleep(0.3)  # leave the cores to the round trip
        comm.Barrier()
        time.sleep(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
