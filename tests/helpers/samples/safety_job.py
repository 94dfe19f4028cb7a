"""Collective safety on whole jobs: every rank ends each case with an error, never a hang.

    mpiexec -n N python safety_job.py SCENARIO OUT_DIR

``abort_on_error`` is off and every error is caught, so what ends each case is
the agreement itself. Each rank appends one line per case to
``OUT_DIR/rank<R>.txt``: ``<case> <seconds> <ExceptionType>: <message>`` (or
``<case> <seconds> ok <detail>``). tests/parallel/test_collective_safety.py reads them.
"""

import gc
import os
import sys
import time
import warnings

import numpy as np

import mpidist as md

scenario, out_dir = sys.argv[1], sys.argv[2]
options = {"abort_on_error": False}
if scenario == "deadline":
    options["timeout"] = 3.0
elif scenario == "stall":
    options["timeout"] = 2.0
strategy = md.MPIStrategy(**options)
comm = strategy.communicator
rank, size = strategy.rank, strategy.num_replicas_in_sync
bad = size - 1  # the rank that misbehaves


def record(case, started, outcome):
    line = f"{case} {time.monotonic() - started:.2f} {outcome}".replace("\n", " ")
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "a") as f:
        f.write(line + "\n")


def case(name, fn):
    started = time.monotonic()
    try:
        detail = fn()
        record(name, started, f"ok {detail}")
    except Exception as exc:  # every rank must end here or above, whatever went wrong
        record(name, started, f"{type(exc).__name__}: {exc}")


def mine(good, wrong):
    return wrong if rank == bad else good


BAD_ARGUMENTS = {
    "unknown_op": lambda: comm.allreduce(np.ones(3), mine("sum", "bogus")),
    "out_shape": lambda: comm.allreduce(np.ones(3), out=mine(np.empty(3), np.empty(4))),
    "inplace_and_out": lambda: comm.allreduce(np.ones(3), inplace=rank == bad, out=np.empty(3)),
    "read_only": lambda: comm.allreduce(_read_only(), inplace=True),
    "byte_order": lambda: comm.allreduce(mine(np.ones(3), np.ones(3, dtype=">f8"))),
    "broadcast_root": lambda: comm.broadcast(np.ones(3), root=mine(0, size + 5)),
    "reduce_scatter_counts": lambda: comm.reduce_scatter(
        np.ones((size, 2)), counts=mine([1] * size, [size + 1] * size)
    ),
    "update_shape": lambda: strategy.run(lambda: variable.assign_add(mine(np.ones(3), np.ones(4)))),
    "reduce_op": lambda: strategy.reduce(mine("sum", "bogus"), np.ones(2)),
}


def _read_only():
    array = np.ones(3)
    array.flags.writeable = rank != bad
    return array


def _from_two_lines():
    if rank == bad:
        return comm.broadcast(np.ones(2))  # site: mismatch bad
    return comm.allreduce(np.ones(2))  # site: mismatch good


MISMATCHES = {
    "shape": lambda: comm.allreduce(np.ones(2 + (rank == bad))),
    "call_sites": _from_two_lines,
    "reduce_scatter_counts_differ": lambda: comm.reduce_scatter(
        np.ones((2 * size, 2)), counts=[2 * size if r == rank % size else 0 for r in range(size)]
    ),
    "empty_nest": lambda: strategy.reduce("sum", mine([np.ones(2), np.ones(3)], [])),
    "different_variable": lambda: strategy.run(lambda: mine(variable, other).assign_add(np.ones(3))),
    "variable_name": lambda: md.Variable(np.zeros(2), name=mine("weights", "bias")),
}


with strategy.scope():
    variable = md.Variable(np.zeros(3), name="a", aggregation=md.VariableAggregation.MEAN)
    other = md.Variable(np.zeros(3), name="b", aggregation=md.VariableAggregation.MEAN)
    if scenario == "bad_arguments":
        for name, fn in BAD_ARGUMENTS.items():
            case(name, fn)
        case("after", lambda: float(comm.allreduce(np.ones(1))[0]))  # the communicator still works
    elif scenario == "mismatch":
        for name, fn in MISMATCHES.items():
            case(name, fn)
        case("after", lambda: float(comm.allreduce(np.ones(1))[0]))
    elif scenario == "deadline":
        if rank == bad:
            record("deadline", time.monotonic(), "ok stayed away")
            time.sleep(options["timeout"] + 4)
        else:
            case("deadline", lambda: comm.allreduce(np.ones(3)))
    elif scenario == "stall":
        # the last rank is late twice: past the warning (halfway to the deadline), then past the deadline; the
        # others wait for it in one collective, rank 0 at a line of its own
        weights = np.ones(2)
        for phase, late in (("warning", 1.5), ("deadline", 4.5)):
            comm.broadcast(weights, name="w")  # site: last seen
            if rank == bad:
                time.sleep(late)
                case(phase, lambda: comm.allreduce(np.ones(3), name="grads"))
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if rank == 0:
                    case(phase, lambda: comm.allreduce(np.ones(3), name="grads"))  # site: wait 0
                else:
                    case(phase, lambda: comm.allreduce(np.ones(3), name="grads"))  # site: wait
            for warning in caught:
                record(f"{phase}-warning", time.monotonic(), f"{warning.filename}:{warning.lineno}: {warning.message}")
    elif scenario == "early_exit":
        comm.barrier()
        if rank == bad:
            record("early_exit", time.monotonic(), "ok left")
            sys.exit(0)
        case("early_exit", lambda: comm.allreduce(np.ones(3)))
    elif scenario == "nonblocking":
        if rank == bad:
            time.sleep(1.5)
        started = time.monotonic()
        handle = comm.iallreduce(np.full(4, rank + 1.0))  # a temporary: the handle keeps it alive
        returned = time.monotonic() - started
        junk = [np.full(4, -7.0) for _ in range(100)]  # reuse of freed memory would show here
        del junk
        gc.collect()
        case("nonblocking", lambda: f"returned={returned:.3f} sum={handle.wait().tolist()}")
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
