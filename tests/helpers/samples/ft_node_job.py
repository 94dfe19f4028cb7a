"""Training steps with fault tolerance on, across nodes; tests/system/test_multinode.py takes one node away.

    mpiexec --with-ft ulfm ... python ft_node_job.py OUT [TIMEOUT]

Each rank writes ``OUT/rank<R>.ready`` (its pid and host) once it trains, then 300 steps of one
mirrored update with a snapshot at the start of each; the survivors of a failure recover and
finish, and write ``OUT/rank<R>.json`` (R: the rank before the failure): the final rank and size,
the variable (300.0 when every step counted once) and when the failure was noticed. A rank whose
collective raised another mpidist error (the deadline's ``CollectiveTimeoutError``, the cut-off
side's ``CutOffError``) writes the error instead (``error``, ``message``, ``missing``,
``raised_at``) and leaves (the cut-off side by raising it: uncaught, the rank ends as a killed
one). TIMEOUT: the strategy's ``timeout`` in seconds (default 60).
"""

import json
import os
import socket
import sys
import time

import numpy as np

import mpidist as md

out = sys.argv[1]
strategy = md.MPIStrategy(device="cpu", timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 60, fault_tolerance=True)
first = strategy.rank
with strategy.scope():
    w = md.Variable(np.zeros(1000), name="w", aggregation="mean")
with open(os.path.join(out, f"rank{first}.ready"), "w") as f:
    json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
step, failures = 0, []


def report(**fields) -> None:
    with open(os.path.join(out, f"rank{first}.json"), "w") as f:
        json.dump(fields, f)


while step < 300:
    try:
        strategy.snapshot(step=step)
        strategy.run(lambda: w.assign_add(np.ones(1000)))
        step += 1
        time.sleep(0.02)
    except md.RankFailedError as failure:
        raised = time.time()
        step = strategy.recover()["step"]
        failures.append({"failed_ranks": list(failure.failed_ranks), "raised_at": raised, "recovered_at": time.time()})
    except md.MpidistError as error:
        missing = getattr(error, "missing_ranks", ())
        report(error=type(error).__name__, message=str(error), missing=list(missing), raised_at=time.time(), step=step)
        if isinstance(error, md.CommError):  # the cut-off side: ends as a dead rank would (killed)
            raise
        os._exit(3)
report(final=[strategy.rank, strategy.num_replicas_in_sync], w=float(w.component[0]), failures=failures)
