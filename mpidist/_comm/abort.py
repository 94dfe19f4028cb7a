"""What happens when a rank fails or leaves, so that the other ranks never wait forever.

Two hooks, both local to install:

- :func:`install_abort_on_error`: an uncaught exception, or ``sys.exit`` with a
  non-zero status, on any rank ends the whole MPI job (``MPI_Abort``) with the
  traceback tagged by rank.
- :func:`install_exit_hook`: a rank that exits normally announces its
  departure to the ranks still making collectives
  (:func:`~mpidist._comm.agreement.leave_all`), which then raise
  :class:`~mpidist.RankLeftError` naming it instead of waiting for the deadline.

Part of the comm layer: the only MPI call here is ``MPI_Abort``.
"""

from __future__ import annotations

import atexit
import sys
import traceback
from types import TracebackType
from typing import Any, NoReturn, Optional, Union

from mpi4py import MPI

from mpidist._comm.agreement import leave_all
from mpidist._errors import on_rank

__all__ = ["install_abort_on_error", "install_exit_hook"]

_state: dict[str, Any] = {"abort": False, "exit_code": None, "hooked": False}


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
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or _keep_default():
            previous_hook(exc_type, exc, tb)
            return
        lines = "".join(traceback.format_exception(exc_type, exc, tb)).splitlines()
        _abort(f"uncaught {exc_type.__name__}", lines, 1)

    def exit(status: Union[str, int, None] = None) -> NoReturn:
        _state["exit_code"] = status
        previous_exit(status)

    sys.excepthook = hook
    sys.exit = exit


def install_exit_hook() -> None:
    """At exit, abort after a failing ``sys.exit`` (with abort-on-error), else announce the departure.

    Local; idempotent.
    """
    if _state["hooked"]:
        return
    _state["hooked"] = True
    atexit.register(_at_exit)


def _at_exit() -> None:
    code = _state["exit_code"]
    if _state["abort"] and code not in (None, 0) and not _keep_default():
        _abort(f"sys.exit({code!r})", [], code if isinstance(code, int) else 1)
    leave_all()
