"""A nonblocking collective in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from mpi4py import MPI

from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._comm.agreement import Ticket

__all__ = ["Handle"]

Stage = tuple[list[MPI.Request], Callable[[], Any]]
_SWEEP = 64  # every this many handles held, the communicator lets go of those whose transfer completed


class Handle:
    """A nonblocking collective in flight. ``wait()`` completes it and returns its result.

    The collective runs in two stages: the ranks' agreement on the call, then
    the data transfer, which starts as soon as the agreement completed (in
    :meth:`test`, :meth:`wait` or this rank's next collective). Completing it
    makes no further collective call.

    The communicator holds the handle, with the arrays it reads and writes,
    for as long as MPI may touch them: dropping the last reference before
    :meth:`wait` changes nothing, whenever the garbage collector runs. A
    handle never waited completes at the communicator's ``free()`` or at
    exit, in start order.
    """

    def __init__(
        self, transport: Transport, ticket: Optional[Ticket], stage: Optional[Stage] = None, keep: tuple = ()
    ) -> None:
        self._transport = transport
        self._ticket = ticket
        self._stage = stage
        self._keep: Optional[tuple] = keep
        self._done = False
        self._result: Any = None
        self._failure: Optional[BaseException] = None
        if ticket is not None or (stage is not None and stage[0]):
            held = transport.handles
            held[self] = None  # in flight: held until complete
            if len(held) % _SWEEP == 0:  # handles dropped without wait() must not pile up
                for handle in list(held):
                    handle._let_go_if_done()

    def _data_stage(self, block: bool) -> Optional[Stage]:
        if self._stage is None and self._ticket is not None and (block or self._ticket.test()):
            self._stage = self._ticket.wait()
        return self._stage

    def _release(self) -> None:
        """Local: MPI is done with this handle's buffers; the communicator lets go of it."""
        self._keep = None
        self._transport.handles.pop(self, None)

    def _agreement_failed(self) -> None:
        """Local: let go if the agreement completed with an error (no data moved); not if it was interrupted."""
        if self._ticket is not None and self._ticket.done:
            self._release()

    def _let_go_if_done(self) -> None:
        """Local: release this handle if MPI is done with it (its agreement is never advanced here)."""
        ticket = self._ticket
        if self._stage is None and ticket is not None and ticket.done:  # settled by a later collective
            if ticket.failure is not None:
                self._release()
                return
            self._stage = ticket.result
        if self._stage is not None and self._transport.test(self._stage[0]):
            self._release()

    def abandon(self, error: BaseException) -> None:
        """Local, after ranks died: this handle completed nowhere; its ``wait()`` raises ``error``."""
        self._done = True
        self._failure = error
        self._keep = None
        self._transport.handles.pop(self, None)

    def test(self) -> bool:
        """Local: whether the operation has completed (advances it; does not run the finishing step)."""
        if self._done:
            return True
        try:
            stage = self._data_stage(block=False)
        except BaseException:
            self._agreement_failed()
            raise
        if stage is not None and self._transport.test(stage[0]):
            self._release()
            return True
        return False

    def wait(self) -> Any:
        """Local: block until complete (honouring the communicator's timeout); return the result.

        An error of the collective is raised by this call and again by every later one.
        """
        if not self._done:
            try:
                requests, finish = self._data_stage(block=True)  # type: ignore[misc]
            except BaseException:
                self._agreement_failed()
                raise
            # on an error here the requests may still be in flight: the communicator keeps holding them
            self._transport.wait(requests, self._ticket.what if self._ticket is not None else "nonblocking collective")
            self._done = True
            self._release()
            try:
                self._result = finish()
            except BaseException as exc:
                self._failure = exc
        if self._failure is not None:
            raise self._failure
        return self._result
