"""The deadline: waiting for a collective's requests under ``options.timeout``, and naming who is late.

:class:`Deadline` is the waiting half of the :class:`~mpidist._comm.transport.Transport`
(which inherits it): :meth:`Deadline.poll` completes one request, busy-polling
at first, then yielding the core, then sleeping in growing steps. While it
waits it answers the other ranks' "which collective are you in?" queries;
halfway to the deadline (at most a minute in) it warns naming the ranks that
have not arrived, and at the deadline it raises
:class:`~mpidist.CollectiveTimeoutError` naming them, after which the
communicator is unusable. The rank whose deadline passed tells every other
rank that it gave up; a rank that learns this while it waits (a rank that
arrived late, or that still waits in a later collective) raises
:class:`~mpidist.CollectiveTimeoutError` at once instead of at its own
deadline. Everything here is local; the queries and notices are
point-to-point messages on the private communicator. The deadline errors
raised on this rank are kept for the exit status (:func:`deadline_errors`).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Optional

import numpy as np
from mpi4py import MPI

from mpidist._errors import CollectiveTimeoutError, CommError, format_ranks, on_rank
from mpidist._options import Options

__all__ = ["Deadline", "deadline_errors", "note_deadline_error"]

_TAG_QUERY, _TAG_REPLY, _TAG_GAVE_UP = 7702, 7703, 7704
_SPIN = 50e-6  # seconds of busy polling before a waiting rank starts to yield the core
_YIELD = 20e-3  # seconds of polling with the core yielded between tests before a waiting rank sleeps
_STALL = 60.0  # at most this many seconds before a rank warns that others are late
_missed: list[str] = []  # the deadline errors raised on this rank, oldest first


def deadline_errors() -> list[str]:
    """Local: the messages of the deadline errors (:class:`~mpidist.CollectiveTimeoutError`) raised on this rank.

    Oldest first, also those the program caught: the exit hook ends a rank
    that has any with a failing exit status (:mod:`~mpidist._comm.abort`).
    """
    return list(_missed)


def note_deadline_error(error: CollectiveTimeoutError) -> CollectiveTimeoutError:
    """Local: keep ``error``, about to be raised, for :func:`deadline_errors`; returns it."""
    _missed.append(str(error))
    return error


class Deadline:
    """Completing requests under ``options.timeout``: the transport's waiting, in a class of its own.

    A mixin: the :class:`~mpidist._comm.transport.Transport` sets the attributes
    declared here (so waiting costs no extra call on the per-collective path).
    """

    comm: MPI.Intracomm
    options: Options
    rank: int
    size: int
    seq: int  # the collective in progress, told to ranks that ask
    broken: Optional[str]  # set when the deadline passed: the communicator is unusable
    # Give the core up between tests while waiting (set by the communicator, measured per MPI:
    # with more ranks than cores it pays under MPICH; Open MPI's progress does better spinning).
    yield_while_waiting: bool
    queries: int  # "where are you?" queries this rank sent
    stranded: list[MPI.Request]  # requests a deadline gave up on: held, with their buffers, which MPI may still fill

    def poll(self, request: MPI.Request, what: object) -> None:
        """Local: complete one request of a collective, honouring ``options.timeout``.

        Busy-polls for a few tens of microseconds (the common case at small
        scale), then yields the core between tests for up to 20 ms (progress
        of a nonblocking collective happens in those tests: a rank asleep
        would hold back the ranks waiting for it), then sleeps in growing
        steps of up to a millisecond. Meanwhile it answers other ranks'
        "where are you?" queries. Halfway to the deadline (at most
        a minute in) it warns naming the ranks that have not arrived; at the
        deadline it raises :class:`~mpidist.CollectiveTimeoutError` naming them, and tells every
        other rank that it gave up (a rank told so while it waits raises at once).
        """
        if request.Test():
            return
        if self.broken is not None:  # after a deadline or a departure nothing completes: never wait again
            raise CommError(on_rank(self.rank, f"communicator unusable: {self.broken}"))
        timeout = self.options.timeout
        if timeout is None:
            try:
                request.Wait()
            except MPI.Exception as exc:
                raise CommError(on_rank(self.rank, f"MPI error in {what}: {exc.Get_error_string()}")) from exc
            return
        start = time.perf_counter()
        if self.yield_while_waiting:  # the ranks we wait for may need this core: give it up between tests
            while time.perf_counter() - start < _SPIN:
                os.sched_yield()
                if request.Test():
                    return
        else:
            while time.perf_counter() - start < _SPIN:
                if request.Test():
                    return
        begun = time.monotonic()
        deadline, warn_at = begun + timeout, begun + min(timeout / 2, _STALL)
        what = str(what)  # the description, built only on this slow path
        warned = False
        pause = 0.0
        while not request.Test():
            now = time.monotonic()
            self._answer_queries()
            self.heed_notices(what)
            if now >= deadline or (not warned and now >= warn_at):
                missing = self._missing(request, grace=min(2.0, max(0.2, timeout / 10)))
                if missing is None:
                    return  # completed while asking
                if now < deadline:
                    warned = True
                    warnings.warn(
                        on_rank(
                            self.rank,
                            f"still waiting after {now - begun:.3g} s in {what} "
                            f"(collective #{self.seq}); {_missing_text(missing)}",
                        ),
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    continue
                self.broken = f"{what} (collective #{self.seq}) never completed"
                self.stranded.append(request)
                self._give_up()
                raise note_deadline_error(
                    CollectiveTimeoutError(
                        on_rank(
                            self.rank,
                            f"{what} (collective #{self.seq}) did not complete within {timeout:g} s; "
                            f"{_missing_text(missing)}. A rank that skips a collective, calls a different one, "
                            "or died leaves the others waiting; every rank must call the same collectives in the "
                            "same order. The communicator is unusable from now on.",
                        ),
                        missing,
                    )
                )
            if now - begun < _YIELD:  # a late peer (descheduled, a slow piece): keep the progress going
                os.sched_yield()
            else:
                pause = min(1e-3, pause * 2 or 2e-5)
                time.sleep(pause)

    def _give_up(self) -> None:
        """Local (error path): tell every other rank that this rank gave up on the collective in progress."""
        notice = np.array([self.seq], dtype=np.int64)
        self.stranded += [self.comm.Isend(notice, r, _TAG_GAVE_UP) for r in range(self.size) if r != self.rank]

    def heed_notices(self, what: object) -> None:
        """Local: raise :class:`~mpidist.CollectiveTimeoutError` if other ranks gave up on a collective of this
        communicator (their deadline passed before this rank, or another, arrived); ``what`` is the call this
        rank is in. The collectives of this communicator cannot complete any more, so this rank stops at once.

        :meth:`poll` asks while it waits; the notices are point-to-point messages, never sent while things go well.
        """
        status = MPI.Status()
        gave_up: dict[int, int] = {}
        notice = np.empty(1, dtype=np.int64)
        while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_GAVE_UP, status):
            self.comm.Recv(notice, status.Get_source(), _TAG_GAVE_UP)
            gave_up[status.Get_source()] = int(notice[0])
        if not gave_up:
            return
        ranks = sorted(gave_up)
        first = min(gave_up.values())
        who = f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"
        self.broken = f"{who} gave up on collective #{first} at the deadline"
        raise note_deadline_error(
            CollectiveTimeoutError(
                on_rank(
                    self.rank,
                    f"{who} gave up on collective #{first} when {'their' if len(ranks) > 1 else 'its'} deadline "
                    f"({self.options.timeout:g} s) passed, and raised CollectiveTimeoutError there, so no "
                    f"collective of this communicator can complete any more; this rank stops waiting in {what} "
                    f"(collective #{self.seq}). A rank that reaches a collective more than the timeout after the "
                    "others finds them gone. The communicator is unusable from now on.",
                ),
                ranks,
            )
        )

    def _answer_queries(self) -> None:
        """Local: tell every rank that asked which collective this rank is waiting in."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_QUERY, status):
            query = np.empty(2, dtype=np.int64)
            self.comm.Recv(query, status.Get_source(), _TAG_QUERY)
            self.comm.Isend(np.array([self.seq, query[1]], dtype=np.int64), status.Get_source(), _TAG_REPLY)

    def _missing(self, request: MPI.Request, grace: float) -> Optional[list[int]]:
        """Local (error path): the ranks that do not answer within ``grace`` seconds; None if ``request`` completed.

        Asks every other rank with a point-to-point message; ranks waiting in
        a collective of this communicator answer from their polling loop.
        """
        self.queries += 1
        query = np.array([self.seq, self.queries], dtype=np.int64)
        for r in range(self.size):
            if r != self.rank:
                self.comm.Isend(query, r, _TAG_QUERY)
        answered = {self.rank}
        end = time.monotonic() + grace
        status = MPI.Status()
        reply = np.empty(2, dtype=np.int64)
        while time.monotonic() < end and len(answered) < self.size:
            if request.Test():
                return None
            self._answer_queries()
            while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_REPLY, status):
                self.comm.Recv(reply, status.Get_source(), _TAG_REPLY)
                if reply[1] == self.queries:
                    answered.add(status.Get_source())
            time.sleep(1e-3)
        return [r for r in range(self.size) if r not in answered]


def _missing_text(missing: list[int]) -> str:
    if not missing:
        return "every rank answered, so all are inside collectives of this communicator but not the same one"
    return (
        f"rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} "
        f"{'have' if len(missing) > 1 else 'has'} not arrived (missing or unreachable)"
    )
