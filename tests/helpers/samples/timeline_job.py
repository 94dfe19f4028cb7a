"""A training-like job whose ranks record a timeline (``MPIDIST_TIMELINE`` in the environment).

    mpiexec -n N python timeline_job.py OUT [--steps K] [--slow RANK] [--sleep SECONDS] [--checks-off] [--kill]

Steps of ``strategy.run`` over an input iterator, each with a small mirrored update (it rides in the
agreement's record) and a larger one (its data moves after the agreement), then a nonblocking
allreduce and a barrier. ``--slow RANK`` makes that rank sleep ``--sleep`` seconds in every step,
so that the others wait for it. Each rank writes ``OUT/job-rank<R>.json``: how many collectives
its communicator made. ``--kill``: every rank waits a second and kills itself instead of exiting,
as a scheduler kills a job.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import numpy as np

import mpidist as md

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--slow", type=int, default=None)
parser.add_argument("--sleep", type=float, default=0.02)
parser.add_argument("--checks-off", action="store_true")
parser.add_argument("--kill", action="store_true")
args = parser.parse_args()

options = dict(check_collectives=False, timeout=None) if args.checks_off else {}
strategy = md.MPIStrategy(device="cpu", **options)
comm, rank, n = strategy.communicator, strategy.rank, strategy.num_replicas_in_sync
with strategy.scope():
    small = md.Variable(np.zeros(1), name="small", aggregation=md.VariableAggregation.MEAN)
    large = md.Variable(np.zeros(1 << 15, np.float32), name="large", aggregation=md.VariableAggregation.MEAN)
rows = np.arange(args.steps * 2 * n, dtype=np.float64).reshape(-1, 1)
data = strategy.distribute_dataset(md.ArrayDataset(rows, global_batch_size=2 * n))


def step(batch):
    if rank == args.slow:
        time.sleep(args.sleep)
    small.assign_add(np.ones(1))
    large.assign_add(np.ones(large.shape, np.float32))


for batch in data:
    strategy.run(step, args=(batch,))
handle = comm.iallreduce(np.ones(4), name="nonblocking")
handle.wait()
comm.barrier()
assert np.asarray(small)[0] == args.steps, np.asarray(small)
Path(args.out, f"job-rank{rank}.json").write_text(json.dumps({"collectives": comm._transport.seq, "steps": args.steps}))
if args.kill:
    time.sleep(1.0)  # longer than the timeline's quiet time: its background thread wrote what was recorded
    os.kill(os.getpid(), signal.SIGKILL)
