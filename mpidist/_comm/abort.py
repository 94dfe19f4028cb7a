"""Ending the whole MPI job when one rank fails, instead of leaving the others waiting.

Part of the comm layer: the only MPI call here is ``MPI_Abort``.
"""
from __future__ import annotations

import sys
import traceback
from types import TracebackType
from typing import Optional

from mpi4py import MPI

__all__ = ["install_abort_on_error"]


def install_abort_on_error() -> None:
    """Make an uncaught exception on any rank end the whole MPI job. Local; idempotent.

    Installs a ``sys.excepthook`` that prints the traceback with every line
    tagged ``[rank R]``, then calls ``MPI_Abort`` on ``COMM_WORLD``, so the
    other ranks do not wait forever in their next collective. ``KeyboardInterrupt``,
    a one-rank world and an interactive prompt (``python -i``) keep Python's default
    behaviour.
    """
    if getattr(sys.excepthook, "_mpidist_abort", False):
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        world = MPI.COMM_WORLD
        if issubclass(exc_type, KeyboardInterrupt) or world.size == 1 or hasattr(sys, "ps1"):
            previous(exc_type, exc, tb)  # nobody to wake up, or an interactive prompt to keep alive
            return
        lines = "".join(traceback.format_exception(exc_type, exc, tb)).splitlines()
        banner = (f"mpidist: uncaught {exc_type.__name__} on rank {world.rank} of {world.size}; aborting "
                  "the job so the other ranks do not hang (MPIDIST_ABORT_ON_ERROR=0 turns this off)")
        sys.stderr.write("".join(f"[rank {world.rank}] {line}\n" for line in [banner, *lines]))
        sys.stderr.flush()
        world.Abort(1)

    hook._mpidist_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook
