"""A test-only hook that kills this rank (SIGKILL, as a dead process or node) at a chosen moment.

``MPIDIST_TEST_KILL="RANK:agreement:N"`` kills rank ``RANK`` of ``MPI.COMM_WORLD`` (``R1,R2``: each
of them) as it starts its ``N``-th agreement (counted from 1 over every mpidist communicator of the
process);
``"RANK:piece:N"`` as it starts the ``N``-th piece of a reduction (the pipelined pieces of large
reductions: each one call of the algorithm, or, in the two-level pipeline, one nonblocking reduce
onto the node leader); ``"RANK:call:N"`` as it starts its ``N``-th MPI data collective,
blocking or nonblocking (any collective's, such as a compressed reduction's exchanges and
gatherings). :func:`install` wraps the methods
in place: the library has no hook of its own, and a run without the variable is untouched. Timing
alone would hit a different moment in every run; counting hits the same one. With ``MPIDIST_TEST_KILL_STAMP`` set,
the rank writes the time of its death (``time.time()``) to that file first, for the survivors to
measure how long they took to notice and to carry on.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Any, Callable

from mpi4py import MPI

from mpidist._comm.agreement import Agreement
from mpidist._comm.algorithms.base import Reduction
from mpidist._comm.timeline import TimedAgreement
from mpidist._comm.transport import Transport

__all__ = ["install"]


def install() -> None:
    """Wrap the counted methods when ``MPIDIST_TEST_KILL`` names this rank (nothing otherwise)."""
    spec = os.environ.get("MPIDIST_TEST_KILL", "")
    if not spec:
        return
    ranks, what, n = spec.split(":")
    if MPI.COMM_WORLD.rank not in [int(r) for r in ranks.split(",")]:
        return
    counter = _counter(int(n))
    if what == "agreement":  # the timeline's recording agreement too, whose methods call the plain ones or not
        for cls in (Agreement, TimedAgreement):
            for name in ("agree", "agree_planned", "start", "leave"):
                if name in vars(cls):
                    setattr(cls, name, counter(vars(cls)[name]))
    elif what == "piece":
        Reduction.reduce = counter(Reduction.reduce)  # type: ignore[method-assign]  # the test's own wrapper
        Transport.start = counter(Transport.start, only=lambda _, mpi_name, *args, **kwargs: mpi_name == "Reduce")
    elif what == "call":  # run() starts the nonblocking form under a deadline: counted once (_counter)
        Transport.run = counter(Transport.run)  # type: ignore[method-assign]
        Transport.start = counter(Transport.start)  # type: ignore[method-assign]
    else:
        raise ValueError(f"MPIDIST_TEST_KILL: expected RANK:agreement:N, RANK:piece:N or RANK:call:N, got {spec!r}")


def _counter(limit: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    calls, depth = [0], [0]  # a counted method that calls another counted one counts once

    def wrap(method: Callable[..., Any], only: Callable[..., bool] | None = None) -> Callable[..., Any]:
        """``method`` counted (the calls for which ``only`` is true, if given)."""

        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] or (only is not None and not only(*args, **kwargs)):
                return method(*args, **kwargs)
            calls[0] += 1
            if calls[0] == limit:
                stamp = os.environ.get("MPIDIST_TEST_KILL_STAMP")
                if stamp:  # whole or absent: several ranks may die at once, and the survivors read it
                    part = f"{stamp}.{os.getpid()}"
                    with open(part, "w") as f:
                        f.write(repr(time.time()))
                    os.replace(part, stamp)
                os.kill(os.getpid(), signal.SIGKILL)
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    return wrap
