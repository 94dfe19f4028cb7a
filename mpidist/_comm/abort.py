"""What happens when a rank fails or leaves, so that the other ranks never wait forever.

Two hooks, both local to install:

- :func:`install_abort_on_error`: an uncaught exception, or ``sys.exit`` with a
  non-zero status, on any rank ends the whole MPI job (``MPI_Abort``) with the
  traceback tagged by rank.
- :func:`install_exit_hook`: a rank that exits normally completes its
  nonblocking collectives still in flight and announces its departure to the
  ranks still making collectives (:func:`~mpidist._comm.agreement.leave_all`),
  which then raise :class:`~mpidist.RankLeftError` naming it instead of
  waiting for the deadline. A rank on which a deadline passed
  (:class:`~mpidist.CollectiveTimeoutError`, also when the program caught it)
  then ends with exit status 1 instead of 0, so that the job's status shows
  that it did not run as written.

Part of the comm layer: the only MPI calls here are ``MPI_Abort`` and ``MPI_Finalize``.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import signal
import sys
import time
import traceback
from types import TracebackType
from typing import Any, Callable, NoReturn, Optional, Union

from mpi4py import MPI

from mpidist._comm.agreement import leave_all
from mpidist._comm.deadline import deadline_errors
from mpidist._comm.survival import readiness
from mpidist._errors import CutOffError, on_rank

__all__ = ["call_before_abort", "install_abort_on_error", "install_exit_hook", "leave_alone"]

_FORWARD_PAUSE = 0.2  # seconds between writing the traceback and MPI_Abort (see _abort)
_STAGGER = 0.3  # with ULFM, seconds more per rank (up to rank 10) before MPI_Abort (see _abort)

_state: dict[str, Any] = {"abort": False, "exit_code": None, "hooked": False}
_before_abort: list[Callable[[], None]] = []  # what saves this rank's files before it aborts the job


def call_before_abort(fn: Callable[[], None]) -> None:
    """Local: call ``fn`` when this rank aborts the job (before ``MPI_Abort``), to complete a file it writes."""
    _before_abort.append(fn)


def _keep_default() -> bool:
    """A one-rank world or an interactive prompt: nobody to wake up, or a session to keep alive."""
    return MPI.COMM_WORLD.size == 1 or hasattr(sys, "ps1")


def _abort(what: str, lines: list[str], code: int) -> None:
    world = MPI.COMM_WORLD
    banner = on_rank(
        None,
        f"{what} on rank {world.rank} of {world.size}; aborting the job so the other ranks do "
        "not hang (MPIDIST_ABORT_ON_ERROR=0 turns this off)",
    )
    sys.stderr.write("".join(f"[rank {world.rank}] {line}\n" for line in [banner, *lines]))
    sys.stderr.flush()
    for fn in _before_abort:
        try:
            fn()
        except Exception:  # nothing may stop the abort: the other ranks wait for it
            pass
    # MPICH's launcher may tear the job down as soon as it hears of the abort, before it forwarded what
    # this rank just wrote (seen: a job that ended with status 1 and no traceback); give it a moment
    time.sleep(_FORWARD_PAUSE)
    if readiness()[0]:
        # Under --with-ft ulfm, Open MPI's launcher stayed behind (every rank gone, sometimes exit status 0)
        # in about one job in three where two ranks called MPI_Abort at once after a rank died, and never in
        # 10 runs with the calls 0.3 s apart: the lower ranks abort first, and their abort ends the others.
        time.sleep(_STAGGER * min(world.rank, 10))
    world.Abort(code)


def install_abort_on_error() -> None:
    """Make an uncaught exception or a failing ``sys.exit`` on any rank end the whole MPI job. Local; idempotent.

    Installs a ``sys.excepthook`` that prints the traceback with every line
    tagged ``[rank R]``, then calls ``MPI_Abort`` on ``COMM_WORLD``, so the
    other ranks do not wait forever in their next collective. ``sys.exit(n)``
    with ``n`` not 0 (or a message) aborts the same way at exit; a
    ``SystemExit`` raised directly is not seen. ``KeyboardInterrupt``, a
    one-rank world and an interactive prompt (``python -i``) keep Python's
    default behaviour.
    """
    install_exit_hook()
    if _state["abort"]:
        return
    _state["abort"] = True
    previous_hook = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or _keep_default():
            previous_hook(exc_type, exc, tb)
            return
        lines = "".join(traceback.format_exception(exc_type, exc, tb)).splitlines()
        if issubclass(exc_type, CutOffError):  # the other side of the failure carries on: leave it alone
            leave_alone(lines)
        _abort(f"uncaught {exc_type.__name__}", lines, 1)

    sys.excepthook = hook


def install_exit_hook() -> None:
    """At exit, abort after a failing ``sys.exit`` (with abort-on-error), else announce the departure.

    After the departure, a rank on which a deadline passed ends with exit
    status 1 where it would end with 0. Local; idempotent (it also notes the
    status given to ``sys.exit``).
    """
    if _state["hooked"]:
        return
    _state["hooked"] = True
    _note("started")
    previous_exit = sys.exit

    def exit(status: Union[str, int, None] = None) -> NoReturn:
        _state["exit_code"] = status
        previous_exit(status)

    sys.exit = exit
    atexit.register(_at_exit)


def _at_exit() -> None:
    code = _state["exit_code"]
    if _state["abort"] and code not in (None, 0) and not _keep_default():
        _abort(f"sys.exit({code!r})", [], code if isinstance(code, int) else 1)
    leave_all()
    missed = deadline_errors()
    # sys.last_value: an uncaught exception, which Python's exit status reports already
    if code in (None, 0) and not hasattr(sys, "last_value"):
        if missed:
            _exit_failing(missed)
        _note("finished")


def _note(what: str) -> None:
    """Local: in ``$MPIDIST_FINISHED_DIR``, if set, note that this rank's program ``what`` (``started``: made
    its first mpidist communicator; ``finished``: ended normally), as the file ``<what>-rank<R>``.

    ``jobs/mpirun.sh`` and the batch scripts set it in fault-tolerant jobs,
    whose launcher (Open MPI's under ``--with-ft ulfm``) exits with status 0
    even when every rank was killed (a node lost with its daemon, or every
    survivor stopped): when ranks started and none finished, the scripts fail
    instead.
    """
    directory = os.environ.get("MPIDIST_FINISHED_DIR")
    if directory:
        try:
            with open(os.path.join(directory, f"{what}-rank{MPI.COMM_WORLD.rank}"), "w"):
                pass
        except OSError:  # a directory gone or not writable: the script then reports no rank finished
            pass


def _exit_failing(missed: list[str]) -> NoReturn:
    """End this process with status 1 now: a deadline passed here, and the program ended as if it had not.

    Python offers no way to change the exit status of a program that ended
    normally from an exit hook, so this one finishes the job itself: it
    flushes the files still open, finalises MPI (the launcher then sees a
    clean exit with status 1), and ends the process. Exit hooks registered
    before mpidist's first communicator, and finalizers of objects still
    alive, do not run.
    """
    world = MPI.COMM_WORLD
    banner = on_rank(
        None,
        f"rank {world.rank} of {world.size} ends with exit status 1: {len(missed)} "
        f"CollectiveTimeoutError{'s were' if len(missed) > 1 else ' was'} raised on this rank (and caught), "
        f"so the job did not run as written. The first: {missed[0]}",
    )
    sys.stderr.write(f"[rank {world.rank}] {banner}\n")
    _flush_files()
    if not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(1)


def leave_alone(lines: list[str]) -> NoReturn:
    """End this rank as a dead one: without ``MPI_Abort`` (which would end the ranks that carry on too), without
    ``MPI_Finalize`` (whose barrier would wait for them), and by SIGKILL rather than an exit status: under
    ``--with-ft ulfm`` Open MPI's launcher took a rank that exited with status 1 while the others went on for
    an error and hung at their end (3 runs of 3), and a killed rank for a death they survive."""
    rank = MPI.COMM_WORLD.rank
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    _flush_files()
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # not reached


def _flush_files() -> None:
    """Local: flush every file object still open for writing (``os._exit`` skips Python's closing of them)."""
    for stream in (sys.stdout, sys.stderr, *gc.get_objects()):
        if isinstance(stream, io.IOBase):
            try:
                if not stream.closed and stream.writable():
                    stream.flush()
            except (OSError, ValueError):  # a file that cannot be flushed any more: nothing to save
                pass
