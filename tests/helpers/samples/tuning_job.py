"""How Open MPI's nonblocking allreduce algorithm was settled; tests/parallel/test_tuning.py launches it.

    mpiexec -n N python tuning_job.py {mpi4py-first|mpidist-first} OUT_DIR

Imports ``mpi4py.MPI`` before mpidist (as a script with sorted imports does) or after it,
creates a strategy, reduces a few MiB through the nonblocking path, and writes to
``OUT_DIR/rank<R>.json`` (files, because launchers may interleave the ranks' output): the
library, the control variable's value before and after the strategy, how it was settled,
and whether the reduction was right.
"""

import json
import os
import sys


def main(order: str, out_dir: str) -> None:
    if order == "mpidist-first":
        import mpidist  # noqa: F401 -- before mpi4py.MPI: mpidist's choice goes into the environment
    import numpy as np
    from mpi4py import MPI

    import mpidist as md
    from mpidist._comm import tuning
    from mpidist._comm.library import library_version

    before = tuning.libnbc_iallreduce_algorithm()
    strategy = md.MPIStrategy(device="cpu")
    rank, size = strategy.rank, strategy.num_replicas_in_sync
    data = strategy.communicator.iallreduce(np.full(1 << 20, rank + 1.0, np.float32)).wait()
    setting = tuning.ring_setting()
    result = {
        "library": library_version(),
        "world": MPI.COMM_WORLD.size,
        "before": before,
        "after": tuning.libnbc_iallreduce_algorithm(),
        "how": setting.how,
        "detail": setting.detail,
        "sum_ok": bool((data == size * (size + 1) / 2).all()),
    }
    strategy.free()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
