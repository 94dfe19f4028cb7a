"""MPI calls on a private communicator, under the deadline: the bottom of the comm layer.

A :class:`Transport` owns the duplicate communicator that carries all of
mpidist's traffic. It numbers the collectives, runs each MPI call (blocking,
or nonblocking polled against ``options.timeout``), translates MPI errors into
:class:`~mpidist.CommError`, and reduces buffers with the flat or the
two-level (:mod:`~mpidist._comm.hierarchy`) algorithm. It moves MPI-ready
buffers only: what the buffers hold, and whether the ranks agree on them, is
the business of the layers above (:mod:`~mpidist._comm.agreement`,
:mod:`~mpidist._comm.communicator`, :mod:`~mpidist._comm.fusion`).
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpidist._comm.hierarchy import Hierarchy
from mpidist._comm.reduce_op import ReduceOp
from mpidist._errors import CollectiveTimeoutError, CommError, format_ranks
from mpidist._options import Options

__all__ = ["Transport"]

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.MEAN: MPI.SUM, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.PROD: MPI.PROD}
_BOOL_OPS = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND, ReduceOp.PROD: MPI.LAND}


_TAG_QUERY, _TAG_REPLY = 7702, 7703
_SPIN = 50e-6  # seconds of busy polling before a waiting rank starts to yield the core
_YIELD = 20e-3  # seconds of polling with the core yielded between tests before a waiting rank sleeps
_STALL = 60.0  # at most this many seconds before a rank warns that others are late


def _nothing() -> None:
    """The completion step of requests that need none."""


class Transport:
    """MPI calls on ``comm`` (already a private duplicate), honouring ``options.timeout``.

    Local construction, except the hierarchy's communicators with
    ``options.hierarchical`` (collective). The methods say which are collective.
    """

    def __init__(self, comm: MPI.Intracomm, options: Options) -> None:
        self.comm = comm
        self.options = options
        self.rank: int = comm.rank
        self.size: int = comm.size
        self.seq = 0  # number of the collective in progress (the last one begun)
        self.broken: Optional[str] = None
        self.hierarchy = Hierarchy(comm, options.node_size) if options.hierarchical else None
        # Give the core up between tests while waiting (set by the communicator, measured per MPI:
        # with more ranks than cores it pays under MPICH; Open MPI's progress does better spinning).
        self.yield_while_waiting = False
        self._query_id = 0

    def free(self) -> None:
        """Collective: release the communicators (the hierarchy's and ``comm``)."""
        if self.hierarchy is not None:
            self.hierarchy.free()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.broken = "the communicator was freed"

    def begin(self) -> int:
        """Local: number the next collective (raises if the communicator is unusable)."""
        if self.broken is not None:
            raise CommError(f"rank {self.rank}: communicator unusable: {self.broken}")
        self.seq += 1
        return self.seq

    # -- MPI calls ------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Local: ``fn(*args)`` with MPI errors translated into :class:`~mpidist.CommError`."""
        try:
            return fn(*args)
        except MPI.Exception as exc:
            raise CommError(f"rank {self.rank}: MPI error in {what}: {exc.Get_error_string()}") from exc

    def start(self, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> MPI.Request:
        """Collective: start the nonblocking form of an MPI collective (``Allreduce`` -> ``Iallreduce``).

        On ``comm`` (default: the private duplicate; the hierarchy passes its sub-communicators).
        """
        return self.call(mpi_name, getattr(comm or self.comm, "I" + mpi_name.lower()), *args)

    def run(self, what: str, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> None:
        """Collective: run an MPI collective to completion (on ``comm``, default the private duplicate).

        Without a timeout this is the blocking call (MPI libraries tune those
        best); with one, the nonblocking form polled against the deadline.
        """
        if self.options.timeout is None:
            self.call(what, getattr(comm or self.comm, mpi_name), *args)
        else:
            self.wait([self.start(mpi_name, *args, comm=comm)], what)

    def wait(self, requests: list[MPI.Request], what: str) -> None:
        """Local: complete ``requests``, polling against the timeout when one is set."""
        if self.options.timeout is None:
            try:
                MPI.Request.Waitall(requests)
            except MPI.Exception as exc:
                raise CommError(f"rank {self.rank}: {what} failed in MPI: {exc.Get_error_string()}") from exc
            return
        for request in requests:
            self.poll(request, what)

    # -- waiting with a deadline ---------------------------------------------------------------
    def poll(self, request: MPI.Request, what: object) -> None:
        """Local: complete one request of a collective, honouring ``options.timeout``.

        Busy-polls for a few tens of microseconds (the common case at small
        scale), then yields the core between tests for up to 20 ms (progress
        of a nonblocking collective happens in those tests: a rank asleep
        would hold back the ranks waiting for it), then sleeps in growing
        steps of up to a millisecond. Meanwhile it answers other ranks'
        "where are you?" queries. Halfway to the deadline (at most
        a minute in) it warns naming the ranks that have not arrived; at the
        deadline it raises :class:`~mpidist.CollectiveTimeoutError` naming them.
        """
        if request.Test():
            return
        timeout = self.options.timeout
        if timeout is None:
            try:
                request.Wait()
            except MPI.Exception as exc:
                raise CommError(f"rank {self.rank}: MPI error in {what}: {exc.Get_error_string()}") from exc
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
            if now >= deadline or (not warned and now >= warn_at):
                missing = self._missing(request, grace=min(2.0, max(0.2, timeout / 10)))
                if missing is None:
                    return  # completed while asking
                if now < deadline:
                    warned = True
                    warnings.warn(f"mpidist rank {self.rank}: still waiting after {now - begun:.3g} s in "
                                  f"{what} (collective #{self.seq}); {_missing_text(missing)}",
                                  RuntimeWarning, stacklevel=3)
                    continue
                self.broken = f"{what} (collective #{self.seq}) never completed"
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {what} (collective #{self.seq}) did not complete within {timeout:g} s; "
                    f"{_missing_text(missing)}. A rank that skips a collective, calls a different one, or "
                    "died leaves the others waiting; every rank must call the same collectives in the same "
                    "order. The communicator is unusable from now on.", missing)
            if now - begun < _YIELD:  # a late peer (descheduled, a slow piece): keep the progress going
                os.sched_yield()
            else:
                pause = min(1e-3, pause * 2 or 2e-5)
                time.sleep(pause)

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
        self._query_id += 1
        query = np.array([self.seq, self._query_id], dtype=np.int64)
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
                if reply[1] == self._query_id:
                    answered.add(status.Get_source())
            time.sleep(1e-3)
        return [r for r in range(self.size) if r not in answered]

    @staticmethod
    def test(requests: list[MPI.Request]) -> bool:
        """Local: whether every request has completed."""
        return bool(MPI.Request.Testall(requests))

    # -- reductions of MPI-ready buffers -------------------------------------------------------
    @staticmethod
    def mpi_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
        """Local: the MPI operation of ``op`` for ``dtype`` (logical ones for bool)."""
        return _BOOL_OPS[op] if dtype.char == "?" else _MPI_OPS[op]

    def pieces(self, array: Any) -> list[tuple[int, int]]:
        """Local: ``(lo, hi)`` element ranges of ``options.pipeline_bytes`` covering the flat ``array``."""
        step = max(1, self.options.pipeline_bytes // max(1, array.itemsize))
        return [(lo, min(lo + step, array.size)) for lo in range(0, array.size, step)]

    def reduce(self, what: str, send: Any, recv: Any, mpi_op: MPI.Op) -> None:
        """Collective: ``recv`` <- reduction of every rank's ``send`` (of ``recv`` itself if ``None``).

        Both are MPI-ready buffers; the two-level algorithm with ``options.hierarchical``.
        """
        if self.hierarchy is not None:
            self.hierarchy.allreduce(self, what, send, recv, mpi_op)
        else:
            self.run(what, "Allreduce", MPI.IN_PLACE if send is None else send, recv, mpi_op)

    def start_pieces(self, what: str, pieces: Sequence[tuple[Any, Any]],
                     mpi_op: MPI.Op) -> tuple[list[MPI.Request], Callable[[], None]]:
        """Collective: start the nonblocking reduction of each ``(send or None, recv)`` piece.

        Returns the requests and the step to run once they completed. With
        ``options.hierarchical`` only the reductions within the nodes run in
        the background; that step runs the rest.
        """
        hierarchy = self.hierarchy
        if hierarchy is None:
            return [self.start("Allreduce", MPI.IN_PLACE if s is None else s, r, mpi_op) for s, r in pieces], _nothing

        def complete() -> None:
            for _, r in pieces:
                hierarchy.complete(self, what, r, mpi_op)

        return [hierarchy.start(self, s, r, mpi_op) for s, r in pieces], complete

    def broadcast(self, what: str, buf: Any, root: int) -> None:
        """Collective: root's MPI-ready ``buf`` into every rank's."""
        self.run(what, "Bcast", buf, root)

    def allgather_bytes(self, what: str, data: bytes) -> list[bytes]:
        """Collective: every rank's ``data``, in rank order, as raw buffers (no agreement, never pickled)."""
        local = np.frombuffer(bytes(data), dtype=np.uint8)
        lengths = np.empty(self.size, dtype=np.int64)
        self.run(what, "Allgather", np.array([local.size], dtype=np.int64), lengths)
        joined = np.empty(int(lengths.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.run(what, "Allgatherv", local, [joined, (lengths.tolist(), displs.tolist()), MPI.BYTE])
        blob = joined.tobytes()
        return [blob[lo:lo + n] for lo, n in zip(displs.tolist(), lengths.tolist())]


def _missing_text(missing: list[int]) -> str:
    if not missing:
        return "every rank answered, so all are inside collectives of this communicator but not the same one"
    return (f"rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} "
            f"{'have' if len(missing) > 1 else 'has'} not arrived (missing or unreachable)")
