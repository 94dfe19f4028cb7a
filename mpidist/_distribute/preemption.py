"""Coordinated stops: a stop asked for on any rank is seen by every rank at the same step.

A job that is about to be preempted (Slurm's ``--signal``, a time limit, an
operator) must write one consistent checkpoint and exit on every rank
together. The signal may reach only some ranks, or reach them at different
moments, so no rank may act on it alone: a rank that got it *asks* for a
stop (:meth:`Stopper.request`, or a signal handler installed by
:meth:`Stopper.install`), and the ranks learn of the request together.

How the request travels:

- With collective checks on (the default: ``check_collectives``, a
  ``timeout`` or ``check_finite``), every collective starts with one small
  agreement reduction (:mod:`~mpidist._comm.agreement`). Its record has a
  stop slot: the request rides the next collective any rank makes, and every
  rank marks the stop as agreed at that same collective. No message is added;
  :meth:`Stopper.should_stop` only reads the mark (local). A training step
  that updates a mirrored variable makes such a collective, so a request is
  seen at the end of the step in which it arrived, or of the next one.
- With every check off there is no agreement record. Then every
  ``check_every``-th call of :meth:`Stopper.should_stop` is a collective: one
  allreduce of one integer. A request is seen within ``check_every`` calls
  (on average one allreduce of 8 bytes per ``check_every`` steps).
- In a one-rank world there is nobody to agree with: the request is seen at
  the next :meth:`Stopper.should_stop`.

Signal handlers only set a flag (Python runs them between bytecodes of the
main thread), so they are safe at any moment, also inside a collective.
"""

from __future__ import annotations

import signal as _signal
from types import FrameType
from typing import Any, Optional, Union

import numpy as np

from mpidist._comm.communicator import Communicator
from mpidist._comm.reduce_op import ReduceOp

__all__ = ["Stopper"]

SignalLike = Union[int, _signal.Signals]
DEFAULT_SIGNALS = (_signal.SIGUSR1, _signal.SIGTERM)
DEFAULT_CHECK_EVERY = 10


class Stopper:
    """The stop request and its agreement for one communicator. Local construction.

    Args:
        communicator: the communicator whose ranks stop together.
    """

    def __init__(self, communicator: Communicator) -> None:
        self._comm = communicator
        self._requested = False  # this rank asked
        self._agreed = False  # every rank knows (the agreement, an explicit check, or a rank alone asked)
        self._calls = 0  # should_stop() calls since the last explicit check
        self._handlers: dict[int, Any] = {}
        self.signal: Optional[int] = None  # the last signal that asked for a stop on this rank

    @property
    def requested(self) -> bool:
        """Whether this rank asked for a stop (by :meth:`request` or a signal)."""
        return self._requested

    def request(self) -> None:
        """Local: ask every rank to stop; safe inside a signal handler.

        The request rides the next agreement record (or the next explicit
        check, with every check off); from then on :meth:`should_stop` is
        ``True`` on every rank.
        """
        self._requested = True
        self._comm.agreement.stop_requested = True
        if self._comm.size == 1:  # a rank alone has nobody to tell: its request is agreed at once
            self._agreed = True

    def should_stop(self, check_every: int = DEFAULT_CHECK_EVERY) -> bool:
        """Whether every rank has agreed to stop: the same answer on every rank at the same call.

        Local with collective checks on (it reads what the last collective
        brought); with every check off, collective on every ``check_every``-th
        call (one allreduce of one integer), so every rank must call it
        equally often. Call it where no nonblocking collective is in flight
        (between steps).
        """
        if not isinstance(check_every, int) or check_every < 1:  # also where unused: not first when checks go off
            raise ValueError(f"should_stop: check_every must be a positive int, got {check_every!r}")
        if self._agreed:
            return True
        agreement = self._comm.agreement
        if agreement.enabled:
            self._agreed = agreement.stop_agreed
        else:
            self._calls += 1
            if self._calls >= check_every:
                self._calls = 0
                flag = np.array([int(self._requested)], dtype=np.int32)
                total = self._comm.allreduce(flag, ReduceOp.SUM, name="stop request")
                self._agreed = bool(total[0])
        return self._agreed

    def install(self, signals: tuple[SignalLike, ...] = DEFAULT_SIGNALS) -> dict[int, Any]:
        """Local: make each of ``signals`` ask for a coordinated stop instead of ending the process.

        Must run in the main thread. Returns the handlers that were replaced
        (``{signal number: previous handler}``); :meth:`uninstall` puts them back.
        """
        previous = {}
        for sig in signals:
            number = int(sig)
            previous[number] = _signal.signal(number, self._handle)
            self._handlers.setdefault(number, previous[number])
        return previous

    def uninstall(self) -> None:
        """Local: restore the handlers :meth:`install` replaced."""
        for number, handler in self._handlers.items():
            _signal.signal(number, handler if handler is not None else _signal.SIG_DFL)
        self._handlers.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.signal = signum
        self.request()


def signal_numbers(signals: tuple[Any, ...]) -> tuple[int, ...]:
    """Local: signal numbers from numbers, ``signal.Signals`` or names (``"SIGUSR1"``, ``"USR1"``)."""
    out = []
    for sig in signals:
        if isinstance(sig, str):
            name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
            if not hasattr(_signal.Signals, name):
                raise ValueError(f"unknown signal {sig!r}; use e.g. signal.SIGUSR1 or 'SIGUSR1'")
            out.append(int(_signal.Signals[name]))
        elif isinstance(sig, (int, _signal.Signals)) and not isinstance(sig, bool):
            out.append(int(sig))
        else:
            raise TypeError(f"expected a signal (signal.SIGUSR1, 10 or 'SIGUSR1'), got {type(sig).__name__} {sig!r}")
    return tuple(out)
