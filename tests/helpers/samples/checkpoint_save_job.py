"""An MPI job whose checkpoint saves are killed with SIGKILL; run by tests/unit/test_checkpoint_format.py.

    mpiexec -n N python checkpoint_save_job.py DIRECTORY MODE

Every save k holds a mirrored variable filled with k, a sync-on-read SUM counter
whose total is 10 * k, and an iterator-like object at position k, so a test can
tell that all entries of a save belong together. Save 1 always completes. Then:

- ``kill-during-write``: each rank kills itself (SIGKILL) in the middle of
  writing its first piece of save 2's data;
- ``kill-before-commit``: rank 0 kills itself after save 2 is completely
  written and its manifest is on disk, just before the rename that commits it;
- ``loop``: saves 2, 3, ... until killed from outside; each rank writes its pid
  to ``DIRECTORY.pids/rank<R>`` first.

The job never ends on its own except with exit status 3 (a kill did not happen).
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np

import mpidist
from mpidist._checkpoint.checkpoint import Checkpoint
from resumable import Position

ELEMENTS = 4 << 20  # 16 MiB of float32, written in 1 MiB chunks


def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def main(directory: str, mode: str) -> int:
    strategy = mpidist.MPIStrategy()
    with strategy.scope():
        weights = mpidist.Variable(np.zeros(ELEMENTS, np.float32), name="weights")
        counter = mpidist.Variable(np.zeros((), np.int64), name="counter", synchronization="on_read", aggregation="sum")
    position = Position()
    checkpoint = Checkpoint(weights=weights, counter=counter, position=position)

    def save(k: int) -> None:
        with strategy.scope():
            weights.assign(np.full(ELEMENTS, k, np.float32))
            counter.assign(np.array(10 * k))
        position.position = k
        checkpoint.save(directory, keep=2, block_bytes=1 << 20)

    save(1)
    if mode == "kill-during-write":
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):
            if offset == 0:  # an .npy header, written by rank 0 before the data
                return real_pwrite(fd, data, offset)
            real_pwrite(fd, memoryview(data)[: len(data) // 2], offset)
            die()

        os.pwrite = pwrite
    elif mode == "kill-before-commit":
        os.rename = die
    elif mode == "loop":
        pids = Path(directory + ".pids")
        pids.mkdir(exist_ok=True)
        (pids / f"rank{strategy.rank}").write_text(str(os.getpid()))
        for k in range(2, 10_000):
            save(k)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    save(2)
    return 3


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
