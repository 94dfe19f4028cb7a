"""A nonblocking collective in flight."""
from __future__ import annotations

from typing import Any, Callable

from mpi4py import MPI

from mpidist._comm.transport import Transport

__all__ = ["Handle"]


class Handle:
    """A nonblocking collective in flight. ``wait()`` completes it and returns its result."""

    def __init__(self, transport: Transport, what: str, requests: list[MPI.Request],
                 finish: Callable[[], Any]) -> None:
        self._transport = transport
        self._what = what
        self._requests = requests
        self._finish = finish
        self._done = False
        self._result: Any = None

    def test(self) -> bool:
        """Local: whether the operation has completed (does not run the finishing step)."""
        return self._done or self._transport.test(self._requests)

    def wait(self) -> Any:
        """Local: block until complete (honouring the communicator's timeout); return the result."""
        if not self._done:
            self._transport.wait(self._requests, self._what)
            self._result = self._finish()
            self._done = True
        return self._result
