"""A checkpoint save whose pruning is killed (SIGKILL) at its N-th file-system step; run by
tests/unit/test_checkpoint_prune.py.

    python checkpoint_prune_job.py DIRECTORY N

Saves 1, 2 and 3 (each a mirrored variable filled with k and an iterator at position k) are
kept; a leftover of a killed save is added; then save 4 with keep=1 removes saves 1-3 and the
leftover, and the process kills itself at the N-th rename, unlink or rmdir of that removal.
Exit status 3: the removal needed fewer than N steps (no kill happened).
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist._checkpoint import format as fmt
from mpidist._checkpoint.checkpoint import Checkpoint
from resumable import Position


def main(directory: str, kill_at: str) -> int:
    strategy = mpidist.MPIStrategy(comm=MPI.COMM_SELF, device="cpu")
    with strategy.scope():
        weights = mpidist.Variable(np.zeros(64, np.float32), name="weights")
    position = Position()
    checkpoint = Checkpoint(weights=weights, position=position)

    def save(k: int, keep: int) -> None:
        with strategy.scope():
            weights.assign(np.full(64, k, np.float32))
        position.position = k
        checkpoint.save(directory, keep=keep, block_bytes=64)

    for k in (1, 2, 3):
        save(k, keep=3)
    leftover = Path(directory) / f"{fmt.TMP_PREFIX}000003-0badf00d"
    leftover.mkdir()
    (leftover / "0000-weights.npy").write_bytes(b"partial")
    steps = {"left": int(kill_at), "active": False}
    real = {name: getattr(os, name) for name in ("rename", "unlink", "rmdir")}

    def counted(name):
        def step(*args, **kwargs):
            if steps["active"]:
                if steps["left"] == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                steps["left"] -= 1
            return real[name](*args, **kwargs)

        return step

    for name in real:
        setattr(os, name, counted(name))
    real_prune = fmt.prune

    def prune(*args, **kwargs):
        steps["active"] = True
        try:
            return real_prune(*args, **kwargs)
        finally:
            steps["active"] = False

    fmt.prune = prune
    save(4, keep=1)
    return 3


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
