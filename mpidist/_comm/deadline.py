"""The deadline: waiting for a collective's requests under ``options.timeout``, and naming who is late.

:class:`Deadline` is the waiting half of the :class:`~mpidist._comm.transport.Transport`
(which inherits it): :meth:`Deadline.poll` completes one request, busy-polling
at first, then yielding the core, then sleeping in growing steps. While it
waits it answers the other ranks' "where are you?" queries with the
collective it waits in and the ``file:line`` of the program's call;
halfway to the deadline (at most a minute in) it warns saying where every
rank waits and naming the ranks that have not answered, with where this rank
last saw them (their previous collective), and at the deadline it raises
:class:`~mpidist.CollectiveTimeoutError` saying the same, after which the
communicator is unusable. The rank whose deadline passed tells every other
rank that it gave up; a rank that learns this while it waits (a rank that
arrived late, or that still waits in a later collective) raises
:class:`~mpidist.CollectiveTimeoutError` at once instead of at its own
deadline. Everything here is local; the queries and notices are
point-to-point messages on the private communicator. The deadline errors
raised on this rank are kept for the exit status (:func:`deadline_errors`).
The time a rank spends waiting here, in waits longer than the busy polling,
adds up in :attr:`Deadline.waited`, for the straggler report
(:mod:`~mpidist._comm.straggler`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.call_site import Site, call_site, site_text, warn_at_caller
from mpidist._errors import CollectiveTimeoutError, CommError, format_ranks, on_rank
from mpidist._options import Options

__all__ = ["Deadline", "deadline_errors", "note_deadline_error", "whereabouts_text"]

_TAG_QUERY, _TAG_REPLY, _TAG_GAVE_UP = 7702, 7703, 7704
_SPIN = 50e-6  # seconds of busy polling before a waiting rank starts to yield the core
_YIELD = 20e-3  # seconds of polling with the core yielded between tests before a waiting rank sleeps
_STALL = 60.0  # at most this many seconds before a rank warns that others are late
_LIMIT = 2000  # characters of the ranks' whereabouts in one message (then the groups are counted)
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
    refusal: Optional[Callable[[], CommError]]  # while broken: the error its collectives raise (None: unusable)
    # Give the core up between tests while waiting (set by the communicator, measured per MPI:
    # with more ranks than cores it pays under MPICH; Open MPI's progress does better spinning).
    yield_while_waiting: bool
    queries: int  # "where are you?" queries this rank sent
    replies: list[MPI.Request]  # answers to other ranks' queries still being sent (held with their buffers)
    stranded: list[MPI.Request]  # requests a deadline gave up on: held, with their buffers, which MPI may still fill
    waited: float  # seconds this rank waited for requests, in waits longer than the busy polling
    # The call whose identity this rank's last agreement record carried, from which collective on, and where
    # this rank first made such a call; then the same of the call before it (calls: their ``Call``, or None;
    # written by the agreement when the identity changes): what _recall reads
    recent: tuple[int, object, Site, object, Site]

    def error(self, what: str, exc: MPI.Exception) -> CommError:
        """Local: the error to raise for MPI's ``exc`` in ``what`` (the transport's translation)."""
        raise NotImplementedError

    def unusable(self) -> CommError:
        """Local (error path): the error for a collective while :attr:`broken` is set."""
        if self.refusal is not None:
            return self.refusal()
        return CommError(on_rank(self.rank, f"communicator unusable: {self.broken}"))

    def poll(self, request: MPI.Request, what: object) -> None:
        """Local: complete one request of a collective, honouring ``options.timeout``.

        ``what`` is the call (its ``Call``) while the ranks agree on it, or a
        description of a data transfer. Busy-polls for a few tens of
        microseconds (the common case at small scale), then yields the core
        between tests for up to 20 ms (progress of a nonblocking collective
        happens in those tests: a rank asleep would hold back the ranks
        waiting for it), then sleeps in growing steps of up to a
        millisecond. Meanwhile it answers other ranks' "where are you?"
        queries. Halfway to the deadline (at most a minute in) it warns
        saying where each rank waits and naming the ranks that do not answer;
        at the deadline it raises :class:`~mpidist.CollectiveTimeoutError`
        saying the same, and tells every other rank that it gave up (a rank
        told so while it waits raises at once). The time from the first test
        to completion adds up in :attr:`waited` when it outlasts the busy
        polling (shorter waits are far below what the straggler report
        counts, and the busy polling stays as it was). An MPI error (ranks
        died, with or without fault tolerance) is raised as :meth:`error`
        translates it.
        """
        try:  # free until an MPI error (Python 3.11); then: which ranks died, or what MPI said
            if request.Test():
                return
            if self.broken is not None:  # after a deadline or a departure nothing completes: never wait again
                raise self.unusable()
            timeout = self.options.timeout
            start = time.perf_counter()
            if timeout is None:
                request.Wait()
                self.waited += time.perf_counter() - start
                return
            if self.yield_while_waiting:  # the ranks we wait for may need this core: give it up between tests
                while time.perf_counter() - start < _SPIN:
                    os.sched_yield()
                    if request.Test():
                        return
            else:
                while time.perf_counter() - start < _SPIN:
                    if request.Test():
                        return
            # the ranks whose contribution this rank lacks made the collective before this one (while the ranks
            # agree on a call), or this one (in its data transfer: they may have started it without waiting)
            last = self.seq - 1 if not isinstance(what, str) else self.seq
            begun = time.monotonic()
            deadline, warn_at = begun + timeout, begun + min(timeout / 2, _STALL)
            what = str(what)  # the description, built only on this slow path
            warned = False
            pause = 0.0
            while not request.Test():
                now = time.monotonic()
                self._answer_queries(what)
                self.heed_notices(what)
                if now >= deadline or (not warned and now >= warn_at):
                    found = self._missing(request, what, grace=min(2.0, max(0.2, timeout / 10)))
                    if found is None:
                        break  # completed while asking
                    places, missing = found
                    where = self._whereabouts(places, missing, last)
                    if now < deadline:
                        warned = True
                        warn_at_caller(
                            on_rank(
                                self.rank,
                                f"still waiting after {now - begun:.3g} s in {what} (collective #{self.seq}); {where}",
                            )
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
                                f"{where}. A rank that skips a collective, calls a different one, "
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
            self.waited += time.perf_counter() - start
        except MPI.Exception as exc:
            raise self.error(str(what), exc) from exc

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

    def _answer_queries(self, what: str) -> None:
        """Local: tell every rank that asked where this rank waits: the collective's number, the ``file:line`` of
        the program's call, and ``what`` (the call in words)."""
        status = MPI.Status()
        if self.replies:
            self.replies = [r for r in self.replies if not r.Test()]
        while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_QUERY, status):
            query = np.empty(2, dtype=np.int64)
            self.comm.Recv(query, status.Get_source(), _TAG_QUERY)
            answer = f"{self.seq}\n{query[1]}\n{call_site()}\n{what}".encode(errors="replace")
            self.replies.append(self.comm.Isend([answer, MPI.BYTE], status.Get_source(), _TAG_REPLY))

    def _missing(
        self, request: MPI.Request, what: str, grace: float
    ) -> Optional[tuple[dict[int, tuple[int, str, str]], list[int]]]:
        """Local (error path): where the ranks that answer within ``grace`` seconds wait, ``{rank: (collective
        number, file:line, call)}`` (this rank too), and the ranks that do not answer; None if ``request``
        completed.

        Asks every other rank with a point-to-point message; ranks waiting in
        a collective of this communicator answer from their polling loop.
        """
        self.queries += 1
        query = np.array([self.seq, self.queries], dtype=np.int64)
        for r in range(self.size):
            if r != self.rank:
                self.comm.Isend(query, r, _TAG_QUERY)
        places = {self.rank: (self.seq, call_site(), what)}
        end = time.monotonic() + grace
        status = MPI.Status()
        while time.monotonic() < end and len(places) < self.size:
            if request.Test():
                return None
            self._answer_queries(what)
            while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_REPLY, status):
                reply = bytearray(status.Get_count(MPI.BYTE))
                self.comm.Recv([reply, MPI.BYTE], status.Get_source(), _TAG_REPLY)
                seq, asked, site, call = reply.decode(errors="replace").split("\n", 3)
                if int(asked) == self.queries:
                    places[status.Get_source()] = (int(seq), site, call)
            time.sleep(1e-3)
        return places, [r for r in range(self.size) if r not in places]

    def _whereabouts(self, places: dict[int, tuple[int, str, str]], missing: list[int], last: int) -> str:
        """Local (error path): where the ranks wait, and where this rank last saw those that do not answer (at
        its collective #``last``), in words."""
        return whereabouts_text(places, missing, (last, *self._recall(last)))

    def _recall(self, n: int) -> tuple[str, str]:
        """Local (error path): where this rank made collective #``n`` (the ``file:line`` where it first made such a
        call, or ``""``) and the call in words, for the one in progress and the one before it; ``("", "")`` for
        others."""
        changed, call, site, before, before_site = self.recent
        if n == self.seq - 1 and changed == self.seq:  # the call in progress is the first of its identity in a row
            call, site = before, before_site
        elif n not in (self.seq, self.seq - 1):
            return "", ""
        return (site_text(site), str(call)) if call is not None else ("", "")


def whereabouts_text(places: dict[int, tuple[int, str, str]], missing: list[int], last: tuple[int, str, str]) -> str:
    """Local: ``"ranks 0-2 wait at train.py:88 (#1042 allreduce of 'grads' ...); rank 3 has not answered ..., last
    seen in #1041 allreduce of 'loss' ..., a call this rank first made at train.py:95"``.

    ``places``: where each answering rank waits, ``(collective number, file:line, call)``; ``missing``: the ranks
    that did not answer; ``last``: the collective they made last, in the same form, with the ``file:line`` where
    this rank first made that call ("" for what is not known). Ranks at the same place are grouped; past about
    2,000 characters the groups are counted.
    """
    groups: dict[tuple[int, str, str], list[int]] = {}
    for r, place in sorted(places.items()):
        groups.setdefault(place, []).append(r)
    parts = [f"{_ranks(ranks)} wait{'' if len(ranks) > 1 else 's'} {_place(*place)}" for place, ranks in groups.items()]
    text = "; ".join(parts)
    if len(text) > _LIMIT:
        text = text[:_LIMIT].rsplit("; ", 1)[0] + f"; ... ({len(groups)} places in all)"
    if not missing:
        return f"every rank answered, so all are inside collectives of this communicator but not the same one: {text}"
    many = len(missing) > 1
    seq, site, call = last
    seen = f"#{seq} {call}".rstrip() + (f", a call this rank first made at {site}" if site else "")
    return (
        f"{text}; {_ranks(missing)} {'have' if many else 'has'} not answered (outside mpidist, or unreachable), "
        f"last seen in {seen}"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def _place(seq: int, site: str, call: str) -> str:
    """``at train.py:88 (#1042 allreduce of 'grads')``; ``in #1042 ...`` without a site."""
    number = f"#{seq} {call}".rstrip()
    return f"at {site} ({number})" if site else f"in {number}"
