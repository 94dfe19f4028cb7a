"""A nonblocking collective in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from mpi4py import MPI

from mpidist._comm.transport import Transport

if TYPE_CHECKING:
    from mpidist._comm.agreement import Ticket

__all__ = ["Handle"]

Stage = tuple[list[MPI.Request], Callable[[], Any]]


class Handle:
    """A nonblocking collective in flight. ``wait()`` completes it and returns its result.

    The collective runs in two stages: the ranks' agreement on the call, then
    the data transfer, which starts as soon as the agreement completed (in
    :meth:`test`, :meth:`wait` or this rank's next collective). The handle
    keeps the arrays it reads and writes alive until it completes.
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

    def _data_stage(self, block: bool) -> Optional[Stage]:
        if self._stage is None and self._ticket is not None and (block or self._ticket.test()):
            self._stage = self._ticket.wait()
        return self._stage

    def test(self) -> bool:
        """Local: whether the operation has completed (advances it; does not run the finishing step)."""
        if self._done:
            return True
        stage = self._data_stage(block=False)
        return stage is not None and self._transport.test(stage[0])

    def wait(self) -> Any:
        """Local: block until complete (honouring the communicator's timeout); return the result."""
        if not self._done:
            requests, finish = self._data_stage(block=True)  # type: ignore[misc]
            self._transport.wait(requests, self._ticket.what if self._ticket is not None else "nonblocking collective")
            self._result = finish()
            self._done = True
            self._keep = None
        return self._result
