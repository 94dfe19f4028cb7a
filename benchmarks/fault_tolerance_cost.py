"""What fault tolerance costs when nothing fails: mirrored MEAN updates with ``fault_tolerance`` off and on.

    MPIDIST_FAULT_TOLERANCE=1 bash jobs/mpirun.sh -n 2 python benchmarks/fault_tolerance_cost.py
    # options: --rounds 41 --sizes 8,67108864

Two strategies over the same ranks, one with ``fault_tolerance=True`` and one with it ``False`` (set
explicitly on both, whatever ``MPIDIST_FAULT_TOLERANCE`` says), update a
mirrored float32 MEAN variable with ``v.assign_add(g)`` in ``strategy.run``; the gradient ``g`` is
written with new rank-dependent values before every call, as a backward pass would. Each call is timed
alone (the write, a barrier, the call; the slowest rank's time; ``mpidist._tools.bench.sample``). In
each round each variant samples in turn, the order alternating between rounds, and so does one copy of
the variable's size with NumPy (``np.copyto``: one memory pass, read and write, over the updated
variable), the bound the fault-tolerant update may add. The script prints, per size, the medians and,
round by round, on / off and (on - off) / copy (median and quartiles), with the load average before and
after: on a shared machine only the round-by-round ratios mean something. Launched through
``jobs/mpirun.sh`` with ``MPIDIST_FAULT_TOLERANCE=1``, Open MPI runs with ``--with-ft ulfm`` (both
strategies then run under ULFM, as a fault-tolerant job's do).
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import numpy as np
from mpi4py import MPI

import mpidist as md
from mpidist._tools.bench import Gradients, Variant, sample

_SECONDS_PER_SAMPLE = 0.02  # calls per sample: enough to last about this long


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=41, help="rounds of one sample per variant (default 41)")
    parser.add_argument("--sizes", default="8,67108864", help="bytes of the variable, comma-separated")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    with warnings.catch_warnings():  # rank 0 warns when the job cannot survive a death (not --with-ft ulfm)
        warnings.simplefilter("ignore", RuntimeWarning)
        strategies = {
            "off": md.MPIStrategy(device="cpu", abort_on_error=False, fault_tolerance=False),
            "on": md.MPIStrategy(device="cpu", abort_on_error=False, fault_tolerance=True),
        }
    gradients = Gradients(world.rank)
    loads = [os.getloadavg()]
    for size in (int(s) for s in args.sizes.split(",")):
        n = max(1, size // 4)
        g = np.empty(n, np.float32)
        write = gradients.writer([g])
        variants: dict[str, Variant] = {}
        for name, s in strategies.items():
            with s.scope():
                v = md.Variable(np.full(n, 0.5, np.float32), aggregation=md.VariableAggregation.MEAN)
            variants[name] = Variant(lambda v=v, g=g: v.assign_add(g), write, s)
        copy = np.full(n, 0.5, np.float32)
        variants["copy"] = Variant(lambda copy=copy, g=g: np.copyto(copy, g), write)
        calls = max(1, min(1000, round(_SECONDS_PER_SAMPLE / max(sample(world, variants["off"], 3), 1e-7))))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                samples[name].append(sample(world, variants[name], calls))
        if world.rank == 0:
            on, off, copied = samples["on"], samples["off"], samples["copy"]
            ratios = sorted(a / b for a, b in zip(on, off))
            extra = sorted((a - b) / c for a, b, c in zip(on, off, copied))
            q, e = statistics.quantiles(ratios, n=4), statistics.quantiles(extra, n=4)
            print(
                f"{size} B mirrored MEAN update, {world.size} ranks, {args.rounds} rounds of {calls} calls: "
                f"off {statistics.median(off) * 1e6:.1f} us, on {statistics.median(on) * 1e6:.1f} us, "
                f"one copy {statistics.median(copied) * 1e6:.1f} us; round by round: on / off median "
                f"{statistics.median(ratios):.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f}), "
                f"(on - off) / copy median {statistics.median(extra):.2f} (quartiles {e[0]:.2f}-{e[2]:.2f})",
                flush=True,
            )
    loads.append(os.getloadavg())
    for s in strategies.values():
        s.free()
    if world.rank == 0:
        print(f"load average (1, 5, 15 min) before: {loads[0]}, after: {loads[1]}")


if __name__ == "__main__":
    main()
