"""A small mpidist program that misbehaves on purpose; tests/parallel/test_faults.py launches it.

    mpiexec -n N python fault_job.py SCENARIO

Each rank writes its outcome to ``$FAULT_OUT/rank<R>.txt`` (files, because
launchers may interleave the ranks' standard output) and prints it too.
"""

import os
import signal
import sys
import time

import numpy as np

import mpidist as md

scenario = sys.argv[1]
options = {"timeout": float(os.environ.get("FAULT_TIMEOUT", "0"))} if os.environ.get("FAULT_TIMEOUT") else {}
strategy = md.MPIStrategy(**options)
rank = strategy.rank


def report(outcome):
    with open(os.path.join(os.environ["FAULT_OUT"], f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    print(f"rank {rank}: {outcome}", flush=True)


if scenario == "shape_mismatch":
    try:
        strategy.reduce("sum", md.PerReplica({rank: np.zeros(2 + rank % 2)}))
        report("no error")
    except md.CollectiveMismatchError as exc:
        report(f"CollectiveMismatchError: {exc}")
elif scenario == "skip_collective":
    started = time.monotonic()
    if rank != 1:
        try:
            strategy.barrier()
            report("no error")
        except md.CollectiveTimeoutError as exc:
            seconds = time.monotonic() - started
            report(f"CollectiveTimeoutError after {seconds:.2f} s missing={list(exc.missing_ranks)}: {exc}")
    else:
        report("skipped the collective")
        time.sleep(options["timeout"] + 1.0)  # stay alive (and away) until the others gave up
elif scenario == "raise_on_rank1":
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    strategy.barrier()  # the others wait here; the abort must end them
    report("barrier returned")
elif scenario == "sigkill_rank1":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.barrier()
    report("barrier returned")
elif scenario == "raise_everywhere":
    raise RuntimeError(f"deliberate failure on rank {rank}")
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
