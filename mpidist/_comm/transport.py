"""MPI calls on a private communicator, under the deadline: the bottom of the comm layer.

A :class:`Transport` owns the duplicate communicator that carries all of
mpidist's traffic. It numbers the collectives, runs each MPI call (blocking,
or nonblocking polled against ``options.timeout``: :mod:`~mpidist._comm.deadline`)
and translates MPI errors into :class:`~mpidist.CommError` (an error that says a
rank died goes to :attr:`Transport.on_peer_failure`, the communicator's recovery
with ``fault_tolerance``: :mod:`~mpidist._comm.survival`). It moves MPI-ready
buffers only: what the buffers hold, whether the ranks agree on them and which
algorithm reduces them is the business of the layers above
(:mod:`~mpidist._comm.agreement`, :mod:`~mpidist._comm.algorithms`,
:mod:`~mpidist._comm.communicator`, :mod:`~mpidist._comm.fusion`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.call_site import Site
from mpidist._comm.deadline import Deadline, note_deadline_error
from mpidist._comm.reduce_op import ReduceOp
from mpidist._comm.survival import is_peer_failure, known_failed, revoke
from mpidist._errors import CollectiveTimeoutError, CommError, format_ranks, on_rank
from mpidist._options import Options

if TYPE_CHECKING:
    from mpidist._comm.handle import Handle
    from mpidist._typing import Array

__all__ = ["Transport", "duplicate"]

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.MEAN: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PROD: MPI.PROD,
}
_BOOL_OPS = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND, ReduceOp.PROD: MPI.LAND}


class Transport(Deadline):
    """MPI calls on ``comm`` (already a private duplicate), honouring ``options.timeout``.

    Local construction. The methods say which are collective; waiting under
    the deadline (:meth:`poll`) is inherited from :class:`~mpidist._comm.deadline.Deadline`.
    """

    def __init__(self, comm: MPI.Intracomm, options: Options) -> None:
        self.comm = comm
        self.options = options
        self.rank = comm.rank
        self.size = comm.size
        self.seq = 0  # number of the collective in progress (the last one begun)
        self.broken = None
        self.refusal = None
        self.yield_while_waiting = False
        self.queries = 0
        self.replies: list[MPI.Request] = []
        self.handles: dict[Handle, None] = {}  # nonblocking collectives in flight, in start order
        self.stranded: list[MPI.Request] = []  # requests a deadline gave up on (they keep their buffers)
        self.waited = 0.0
        # whether blocking MPI calls (no timeout) add their time to waited: when the straggler report runs
        self.time_blocking = False
        self.recent: tuple[int, object, Site, object, Site] = (0, None, None, None, None)
        # what an MPI error becomes with fault_tolerance: the communicator's recovery (collective over the
        # survivors) returning the error to raise; None: a rank's death ends the communicator (peer_failed)
        self.on_peer_failure: Optional[Callable[[str, MPI.Exception], CommError]] = None

    def rebind(self, comm: MPI.Intracomm) -> None:
        """Local, after ranks died: carry the survivors' traffic on ``comm`` (their new private communicator).

        Collectives are numbered afresh; what waited on the old communicator
        (answers to queries, requests a deadline gave up on, handles) is
        dropped with it.
        """
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.seq = 0
        self.broken = None
        self.refusal = None
        self.replies = []
        self.stranded = []
        self.handles = {}
        self.recent = (0, None, None, None, None)

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` released ``comm``."""
        return self.comm == MPI.COMM_NULL

    def free(self) -> None:
        """Collective: release ``comm``."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.broken = "the communicator was freed"

    def complete_handles(self) -> None:
        """Collective: complete every handle still in flight, in start order (at ``free()`` and at exit).

        The :class:`~mpidist.Handle` registers itself in :attr:`handles` when it
        starts and leaves once MPI is done with its buffers, so a handle the
        program dropped before ``wait()`` completes here, on every rank at the
        same point. A handle's error stays with the handle (its next ``wait()``
        raises it), as an executor's shutdown leaves errors with its futures.
        Handles of a communicator that a deadline or a departure made unusable
        stay held: they can never complete, and MPI may still write into their
        buffers.
        """
        while self.handles and self.broken is None:
            handle = next(iter(self.handles))
            try:
                handle.wait()
            except Exception:  # the handle keeps it; nothing of it is in flight any more, unless the deadline passed
                if self.broken is None:
                    self.handles.pop(handle, None)

    def begin(self) -> int:
        """Local: number the next collective (raises if the communicator is unusable)."""
        if self.broken is not None:
            raise self.unusable()
        self.seq += 1
        return self.seq

    # -- MPI calls ------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Local: ``fn(*args)`` with MPI errors translated into :class:`~mpidist.CommError`."""
        try:
            return fn(*args)
        except MPI.Exception as exc:
            raise self.error(what, exc) from exc

    def error(self, what: str, exc: MPI.Exception) -> CommError:
        """Local: the :class:`~mpidist.CommError` for MPI's ``exc`` in ``what`` (error path).

        With fault tolerance, what the communicator's recovery returns
        (:attr:`on_peer_failure`, collective over the survivors), whatever the
        error class: a rank's death also shows as ``MPI_ERR_OTHER`` on some
        ranks (seen under Open MPI 5), and a recovery that finds no rank dead
        returns the plain error. Without, when ``exc`` says that ranks died,
        :meth:`peer_failed`.
        """
        if self.on_peer_failure is not None:
            return self.on_peer_failure(what, exc)
        if is_peer_failure(exc):
            return self.peer_failed(what, exc)
        return CommError(on_rank(self.rank, f"MPI error in {what}: {exc.Get_error_string()}"))

    def peer_failed(self, what: str, exc: MPI.Exception) -> CommError:
        """Local (error path), without fault tolerance: ranks died; revoke the communicator, so that every
        survivor's pending and next call fails at once, and return the error naming the ranks this rank knows
        to be dead. The communicator is unusable from then on."""
        dead = known_failed(self.comm)
        revoke(self.comm)
        who = f"rank{'s' if len(dead) > 1 else ''} {format_ranks(dead)}" if dead else "a rank"
        self.broken = f"{who} died"
        return CommError(
            on_rank(
                self.rank,
                f"{who} of this communicator died (MPI: {exc.Get_error_string()}) during {what} "
                f"(collective #{self.seq}); fault tolerance is off, so the communicator is unusable from now on. "
                "MPIStrategy(fault_tolerance=True) or MPIDIST_FAULT_TOLERANCE=1 lets the survivors carry on "
                "(see docs/fault-tolerance.md).",
            )
        )

    def start(self, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> MPI.Request:
        """Collective: start the nonblocking form of an MPI collective (``Allreduce`` -> ``Iallreduce``).

        On ``comm`` (default: the private duplicate; algorithms pass communicators split from it).
        """
        return self.call(mpi_name, getattr(comm or self.comm, "I" + mpi_name.lower()), *args)

    def run(self, what: str, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> None:
        """Collective: run an MPI collective to completion (on ``comm``, default the private duplicate).

        Without a timeout this is the blocking call (MPI libraries tune those
        best); with one, the nonblocking form polled against the deadline.
        """
        if self.options.timeout is None:
            start = time.perf_counter() if self.time_blocking else 0.0
            try:  # as call() does, one Python call less (the per-reduction path)
                getattr(comm or self.comm, mpi_name)(*args)
            except MPI.Exception as exc:
                raise self.error(what, exc) from exc
            if start:
                self.waited += time.perf_counter() - start
        else:
            self.wait([self.start(mpi_name, *args, comm=comm)], what)

    def wait(self, requests: list[MPI.Request], what: str) -> None:
        """Local: complete ``requests``, polling against the timeout when one is set."""
        if self.options.timeout is None:
            start = time.perf_counter() if self.time_blocking else 0.0
            try:
                MPI.Request.Waitall(requests)
            except MPI.Exception as exc:
                raise self.error(what, exc) from exc
            if start:
                self.waited += time.perf_counter() - start
            return
        for request in requests:
            self.poll(request, what)

    def test(self, requests: list[MPI.Request]) -> bool:
        """Local: whether every request has completed (each completed one is done with; the rest advance).

        One ``Test`` per request rather than ``Testall``: MPICH's ``Testall`` fails on the persistent
        request of the agreement at one rank (``MPI_ERR_IN_STATUS`` with a status that holds no error).
        """
        try:
            return all(request.Test() for request in requests)
        except MPI.Exception as exc:
            raise self.error("a test of a nonblocking collective", exc) from exc

    @staticmethod
    def mpi_op(op: ReduceOp, dtype: np.dtype[Any]) -> MPI.Op:
        """Local: the MPI operation of ``op`` for ``dtype`` (logical ones for bool)."""
        return _BOOL_OPS[op] if dtype.char == "?" else _MPI_OPS[op]

    def broadcast(self, what: str, buf: Array, root: int) -> None:
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
        return [blob[lo : lo + n] for lo, n in zip(displs.tolist(), lengths.tolist())]


def duplicate(base: MPI.Intracomm, timeout: Optional[float]) -> MPI.Intracomm:
    """Collective over ``base``: a duplicate of it (the caller frees it), waited for under ``timeout``.

    ``MPI_Comm_idup``, tested in growing sleeps of up to a millisecond, so that
    a rank that never arrives (it failed or left before creating its mpidist
    communicator) costs the others a :class:`~mpidist.CollectiveTimeoutError`
    at the deadline instead of a wait in ``MPI_Comm_dup`` forever.
    """
    try:
        comm, request = base.Idup()
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-5
        while not request.Test():
            if deadline is not None and time.monotonic() > deadline:
                raise note_deadline_error(
                    CollectiveTimeoutError(
                        on_rank(
                            base.rank,
                            f"creating mpidist's communicator over {base.size} ranks: not every rank arrived within "
                            f"{timeout:g} s (a rank failed or exited before it created its strategy or communicator)",
                        )
                    )
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
    except MPI.Exception as exc:
        raise CommError(on_rank(base.rank, f"could not duplicate the communicator: {exc.Get_error_string()}")) from exc
    return comm
