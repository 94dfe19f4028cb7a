"""The straggler report on a whole job: a rank that computes longer is named by rank 0, and no rank otherwise.

    mpiexec -n N python straggler_job.py SCENARIO OUT_DIR

``slow``: 200 steps, each a sleep of 20 ms (the last rank sleeps 30% longer) and one allreduce.
``even``: 10,000 steps of one allreduce and nothing else (tiny steps, no straggler).
Rank 0 writes each straggler line it logs to ``OUT_DIR/lines.txt`` as ``<step> <message>``;
every rank writes ``OUT_DIR/rank<R>.txt``: ``<steps> <seconds>``. tests/parallel/test_straggler_jobs.py reads them.
"""

import logging
import os
import sys
import time

import numpy as np

import mpidist as md

scenario, out_dir = sys.argv[1], sys.argv[2]
strategy = md.MPIStrategy(abort_on_error=False)
comm = strategy.communicator
rank, size = strategy.rank, strategy.num_replicas_in_sync


class Lines(logging.Handler):
    """Each straggler line, with the step (counted from 1) in whose collective it was logged."""

    step = 0

    def emit(self, record: logging.LogRecord) -> None:
        with open(os.path.join(out_dir, "lines.txt"), "a") as f:
            f.write(f"{self.step} {record.getMessage()}\n")


lines = Lines()
logging.getLogger("mpidist.comm").addHandler(lines)
steps, nap = {"slow": (200, 20e-3), "even": (10_000, 0.0)}[scenario]
x = np.ones(3)
started = time.monotonic()
for step in range(1, steps + 1):
    lines.step = step
    if nap:
        time.sleep(nap * 1.3 if rank == size - 1 else nap)
    comm.allreduce(x, name="grads")
with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
    f.write(f"{steps} {time.monotonic() - started:.2f}\n")
