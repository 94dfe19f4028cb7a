"""A small mpidist program with fault tolerance on, one of whose ranks dies on purpose.

    MPIDIST_FAULT_TOLERANCE=1 MPIDIST_TEST_KILL=RANK:agreement:N bash jobs/mpirun.sh -n 4 python ft_job.py SCENARIO

tests/parallel/test_fault_tolerance.py launches it; ``kill_at`` (tests/helpers) kills the rank at
the counted moment. Scenarios: ``allreduce`` (small reductions in a loop), ``pipelined`` (an
8 MiB reduction in 64 pieces; with ``FT_NODE_SIZE=k`` two-level, over "nodes" of ``k`` ranks),
``mirrored`` (steps of two mirrored variables' updates, with a snapshot at the start of each).
Every survivor carries on after ``strategy.recover()`` and writes its outcome as JSON to
``$FT_OUT/rank<R>.json`` (``R``: its rank before the failure).
"""

import json
import os
import sys
import time
import zlib

import numpy as np

import kill_at

kill_at.install()

import mpidist as md  # noqa: E402  (after the hook, which wraps mpidist's methods)

scenario = sys.argv[1]
# FT_NODE_SIZE=k: the two-level reduction over "nodes" of k ranks, whose communicators a failure rebuilds too
node_size = int(os.environ.get("FT_NODE_SIZE", "0"))
levels = {"hierarchical": True, "node_size": node_size} if node_size else {}
strategy = md.MPIStrategy(device="cpu", timeout=60, piece_bytes=128 * 1024, **levels)
first_rank, first_size = strategy.rank, strategy.num_replicas_in_sync
outcome: dict = {"rank": first_rank, "failures": [], "sums": []}
size = {"allreduce": 4, "pipelined": 1 << 20, "mirrored": 1000}[scenario]
with strategy.scope():
    a = md.Variable(np.zeros(size), name="a", aggregation="mean")
    b = md.Variable(np.zeros(size), name="b", aggregation="mean")


def mirrored_step(x: float) -> None:
    a.assign_add(np.full(size, x))
    b.assign_add(np.full(size, 2 * x))


step, steps = 0, 8
while step < steps:
    try:
        started = time.time()
        if scenario == "mirrored":
            strategy.snapshot(step=step)
            strategy.run(mirrored_step, args=(float(step + 1),))
        else:
            total = strategy.reduce("sum", np.ones(size))
            outcome["sums"].append([step, float(total.min()), float(total.max()), strategy.num_replicas_in_sync])
        step += 1
        if outcome["failures"] and "next_step_at" not in outcome:
            outcome["next_step_at"] = time.time()
    except md.RankFailedError as failure:
        raised = time.time()
        state = strategy.recover()
        step = state.get("step", step)
        outcome["failures"].append(
            {
                "failed_ranks": list(failure.failed_ranks),
                "size": failure.size,
                "raised_at": raised,
                "call_started_at": started,
                "recovered_in": time.time() - raised,
                "message": str(failure),
            }
        )
outcome.update(
    final_rank=strategy.rank,
    final_size=strategy.num_replicas_in_sync,
    a=float(a.component[0]),
    b=float(b.component[0]),
    crc=[zlib.crc32(v.component.tobytes()) for v in (a, b)],
    check=strategy.check_mirrored([a, b]),
)
with open(os.path.join(os.environ["FT_OUT"], f"rank{first_rank}.json"), "w") as f:
    json.dump(outcome, f)
print(f"rank {first_rank} of {first_size}: now {strategy.rank} of {strategy.num_replicas_in_sync}", flush=True)
