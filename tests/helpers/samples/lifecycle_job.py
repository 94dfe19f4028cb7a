"""The life cycle of a job around its collectives: handles, strategies and errors at exit.

    mpiexec -n N python lifecycle_job.py SCENARIO OUT_DIR [SETTING]

Each rank appends one line per case to ``OUT_DIR/rank<R>.txt``: ``<case> <seconds> ok <detail>``
or ``<case> <seconds> <ExceptionType>: <message>``; ``<seconds>`` count from the start of the
case. ``SETTING`` is ``default`` or ``checks-off`` (every check off) where a scenario takes one.
tests/parallel/test_lifecycle_jobs.py reads them, and the job's exit status and duration.
"""

import atexit
import gc
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpidist as md

scenario, out_dir = sys.argv[1], sys.argv[2]
SETTINGS = {"default": {}, "checks-off": {"check_collectives": False, "timeout": None}}
setting = SETTINGS[sys.argv[3] if len(sys.argv) > 3 else "default"]
N = 1 << 18  # 2 MiB of float64: MPI reads it while the other ranks arrive
DEADLINE = 20.0  # where a scenario must not wait for a deadline: far above what the job takes
rank = MPI.COMM_WORLD.rank


def record(case, started, outcome):
    line = f"{case} {time.monotonic() - started:.2f} {outcome}".replace("\n", " ")
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "a") as f:
        f.write(line + "\n")


def case(name, fn, started=None):
    started = time.monotonic() if started is None else started
    try:
        record(name, started, f"ok {fn()}")
    except Exception as exc:  # every rank must end here or above, whatever went wrong
        record(name, started, f"{type(exc).__name__}: {exc}")


def collect_garbage_here_only():
    """Allocations that make this rank's garbage collector run, as a report written on one rank would."""
    junk = [[[] for _ in range(100)] for _ in range(3000)]
    del junk
    gc.collect()


if scenario == "never_waited":
    out = np.zeros(N)
    started = time.monotonic()
    # registered before mpidist's exit hook, so it runs after it: the handle has completed by then
    atexit.register(lambda: record("never_waited", started, f"ok {out[0]} {out[-1]}"))
    strategy = md.MPIStrategy(abort_on_error=False, **setting)
    time.sleep(0.2 * rank)  # the others are late: MPI still reads the temporary at exit
    strategy.communicator.iallreduce(np.full(N, rank + 1.0), out=out)  # never waited
elif scenario == "dropped":
    strategy = md.MPIStrategy(abort_on_error=False, **setting)
    comm = strategy.communicator
    time.sleep(0.2 * rank)
    handle = comm.iallreduce(np.full(N, rank + 1.0))
    if rank == 0:  # one rank drops its handle and collects its garbage; the others wait theirs
        del handle
        collect_garbage_here_only()
        junk = [np.full(N, -7.0) for _ in range(8)]
        del junk
    else:
        case("waited", lambda: set(handle.wait().tolist()))
    case("next", lambda: comm.allreduce(np.ones(3)).tolist())
elif scenario == "strategy_in_function":

    def train():
        strategy = md.MPIStrategy(timeout=DEADLINE)
        with strategy.scope():
            v = md.Variable(np.zeros(3), name="v", aggregation=md.VariableAggregation.MEAN)
        for _ in range(3):
            strategy.run(lambda: v.assign_add(np.ones(3)))
        return v.numpy().tolist()

    started = time.monotonic()
    weights = train()  # the strategy is no longer referenced
    if rank == 0:  # rank 0 writes a report; the others exit at once
        collect_garbage_here_only()
        record("report", started, f"ok {weights}")
elif scenario == "checkpoint_errors":

    def restore_another(kind):
        strategy = md.MPIStrategy(abort_on_error=False, timeout=DEADLINE)
        path = os.path.join(out_dir, f"ckpt-{kind}")
        with strategy.scope():
            md.Checkpoint(v=md.Variable(np.zeros(3), name="v")).save(path)
            other = {
                "shape": {"v": md.Variable(np.zeros(4), name="v")},
                "dtype": {"v": md.Variable(np.zeros(3, np.float32), name="v")},
                "name": {"w": md.Variable(np.zeros(3), name="w")},
            }[kind]
            case(f"restore_{kind}", lambda: md.Checkpoint(**other).restore(path))

    for kind in ("shape", "dtype", "name"):
        restore_another(kind)
    strategy = md.MPIStrategy(abort_on_error=False, timeout=DEADLINE)
    with strategy.scope():
        v = md.Variable(np.zeros(3), name="v")
    if rank == 0:  # a save on rank 0 only, while the others exit
        case("save_alone", lambda: md.Checkpoint(v=v).save(os.path.join(out_dir, "alone")))
        collect_garbage_here_only()
elif scenario == "late":
    strategy = md.MPIStrategy(timeout=2.0, abort_on_error=False)
    size, start = strategy.num_replicas_in_sync, time.monotonic()
    late = rank == size - 1
    if late:
        time.sleep(4.0)
    case("reduce", lambda: strategy.reduce("sum", np.ones(2)).tolist())
    case("next", lambda: strategy.reduce("sum", np.ones(2)).tolist())
    if not late:
        unclosed = open(os.path.join(out_dir, f"unclosed{rank}.txt"), "w")  # noqa: SIM115 (left open on purpose)
        unclosed.write("written after the deadline error")
    # the others outlive the late rank's calls; the late rank outlives them (the launcher may end it)
    time.sleep(max(0.0, start + (8.0 if late else 6.0) - time.monotonic()))
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
