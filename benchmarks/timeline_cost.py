"""What the timeline costs per collective: 8-byte calls with ``options.timeline`` off and on, round by round.

    mpiexec -n 2 python benchmarks/timeline_cost.py
    # options: --rounds 101 --calls 8192 --cases update,allreduce

Two strategies, one recording a timeline into a temporary directory (each rank its own file) and one
not, make the same calls: ``update``, a mirrored MEAN variable's ``v.assign_add(g)`` of one float64 in
``strategy.run``; ``allreduce``, ``communicator.allreduce(x, out=out)`` of one float64. In each round,
each variant in turn (the order alternates between rounds) runs a loop of ``--calls`` calls after a
barrier; a loop spans several batches of the timeline's records (it writes them every
``mpidist._comm.timeline.BATCH`` collectives), so every round pays its share of the writing. A call's
time is the slowest rank's mean over the loop. The script prints, per case, each variant's median over
the rounds and the ratio on / off of the two loops of each round (median, quartiles, lowest and
highest), with the load average before and after: on a shared machine only the round-by-round ratio
means something.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import mpidist as md


def _loop(call: Callable[[], object], calls: int) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=101, help="rounds of one loop per variant (default 101)")
    parser.add_argument("--calls", type=int, default=8192, help="calls per loop (default 8192)")
    parser.add_argument("--cases", default="update,allreduce", help="update and/or allreduce")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    directory = tempfile.mkdtemp(prefix="mpidist-timeline-cost-")
    strategies = {
        "off": md.MPIStrategy(device="cpu", abort_on_error=False),
        "on": md.MPIStrategy(device="cpu", abort_on_error=False, timeline=directory),
    }
    x, out = np.ones(1), np.zeros(1)
    loads = [os.getloadavg()]
    for case in args.cases.split(","):
        loops: dict[str, Callable[[], float]] = {}
        for name, s in strategies.items():
            if case == "update":
                with s.scope():
                    v = md.Variable(np.zeros(1), aggregation=md.VariableAggregation.MEAN)

                def timed(s: md.MPIStrategy = s, v: md.MirroredVariable = v) -> float:
                    with s.scope():
                        return float(s.run(_loop(lambda: v.assign_add(x), args.calls)).values[0])

                loops[name] = timed
            else:
                comm = s.communicator
                loops[name] = _loop(lambda comm=comm: comm.allreduce(x, out=out), args.calls)
        for run in loops.values():  # warm up
            run()
        samples: dict[str, list[float]] = {name: [] for name in loops}
        for r in range(args.rounds):
            for name in list(loops) if r % 2 == 0 else list(loops)[::-1]:
                world.Barrier()
                samples[name].append(world.allreduce(loops[name](), op=MPI.MAX) / args.calls)
        if world.rank == 0:
            ratios = sorted(a / b for a, b in zip(samples["on"], samples["off"]))
            q = statistics.quantiles(ratios, n=4)
            print(
                f"{case} 8 B, {world.size} ranks, {args.rounds} rounds of {args.calls} calls: off "
                f"{statistics.median(samples['off']) * 1e6:.2f} us, on {statistics.median(samples['on']) * 1e6:.2f} us "
                f"per call; on / off round by round: median {statistics.median(ratios):.3f}x, quartiles "
                f"{q[0]:.3f}-{q[2]:.3f}, lowest {ratios[0]:.3f}, highest {ratios[-1]:.3f}",
                flush=True,
            )
    loads.append(os.getloadavg())
    for s in strategies.values():
        s.free()
    if world.rank == 0:
        print(f"load average (1, 5, 15 min) before: {loads[0]}, after: {loads[1]}")
    shutil.rmtree(directory, ignore_errors=True)  # the files stay open, unlinked, until exit


if __name__ == "__main__":
    main()
