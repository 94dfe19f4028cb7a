"""What a collective costs, counted: the MPI calls mpidist makes, and the messages the MPI library sends for them.

Counts, unlike timings, do not depend on how many cores the ranks share, so they
check the cost model of the agreement (one allreduce of a fixed-size record,
``O(log N)`` messages per rank) at any number of ranks, also with more ranks
than cores. Two counts per rank and collective (the ``scaling`` case of
:mod:`~mpidist._tools.bench`):

- **mpidist's MPI calls.** :class:`CallCounter` puts counting stand-ins in
  place of a communicator's MPI communicator and of its agreement's persistent
  request: objects of subclasses of mpi4py's own classes, on the same MPI
  handles, that count every call of a method that starts communication (a
  collective, a send, ``Start``); the local queries (``Get_*``) and the tests,
  waits and probes that complete requests (their number depends on timing) are
  not counted. The benchmark puts them in place and takes them out; mpidist's
  code does not change.
- **The library's messages.** The point-to-point messages (and their bytes)
  that the MPI library sends to carry out those calls, its collective
  algorithms' own messages included: Open MPI's monitoring component counts
  every message its point-to-point layer sends, per destination, and offers the
  counts as MPI_T performance variables
  (:class:`~mpidist._comm.library.PerformanceVariables`). It is on only when
  the job starts with it (``OMPI_MCA_pml_monitoring_enable=1``, or ``mpiexec
  --mca pml_monitoring_enable 1``); messages Open MPI moves without its
  point-to-point layer (``coll/sm``, ``coll/han`` when they are selected) are
  not seen. MPICH offers no such counters: its builds carry no performance
  variables unless configured with ``--enable-mpit-pvars``, and its collective
  algorithms send through internal routines below the profiling interface, so
  no wrapper library sees their messages either.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

from mpi4py import MPI

from mpidist._comm.library import PerformanceVariables, library_version

if TYPE_CHECKING:
    from mpidist._comm.communicator import Communicator

__all__ = ["ENABLE_MONITORING", "MESSAGES", "CallCounter", "library_counters"]

# How a job turns Open MPI's monitoring on (every message of the point-to-point layer counted, collectives' too).
ENABLE_MONITORING = "OMPI_MCA_pml_monitoring_enable"
# Open MPI's performance variables with the monitoring on: per rank of a communicator, the messages this process
# sent it and their bytes (through every communicator).
MESSAGES = ("pml_monitoring_messages_count", "pml_monitoring_messages_size")
# mpi4py methods (by name or prefix) that start no communication: they complete requests (how often a rank tests
# depends on timing) or ask for local state.
_NOT_COUNTED = ("Get_", "Test", "Wait", "Iprobe", "Probe", "Improbe", "Mprobe")

_M = TypeVar("_M", bound=Union[MPI.Comm, MPI.Request])


class CallCounter:
    """Local: counts the MPI calls that start communication on the objects it wraps (see the module's docstring).

    ``counts`` maps an mpi4py method's name (``"Allreduce"``, ``"Start"``, ...) to its calls so far.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._classes: dict[type, type] = {}

    def wrap(self, obj: _M) -> _M:
        """Local: an object of a counting subclass of ``type(obj)`` on the same MPI handle (``obj`` stays usable)."""
        cls = type(obj)
        counting = self._classes.get(cls)
        if counting is None:
            counts = self.counts

            class Counting(cls):  # type: ignore[valid-type,misc]  # a subclass of the class of obj, known at run time
                def __getattribute__(self, name: str) -> Any:
                    attr = super().__getattribute__(name)
                    if not name[:1].isupper() or name.startswith(_NOT_COUNTED) or not callable(attr):
                        return attr

                    def counted(*args: Any, **kwargs: Any) -> Any:
                        counts[name] += 1
                        return attr(*args, **kwargs)

                    return counted

            counting = self._classes[cls] = Counting
        return counting(obj)  # mpi4py's constructors copy the handle

    @contextmanager
    def installed(self, communicator: Communicator) -> Iterator[None]:
        """Local: count the MPI calls ``communicator`` makes within the block (its agreement's and its transport's).

        The stand-ins replace the transport's communicator and the agreement's
        persistent request for the block; the originals are back after it,
        before anything frees them.
        """
        agreement = communicator.agreement
        transport = agreement.transport
        comm, request = transport.comm, agreement.request
        transport.comm, agreement.request = self.wrap(comm), self.wrap(request)
        try:
            yield
        finally:
            transport.comm, agreement.request = comm, request


def library_counters() -> tuple[Optional[PerformanceVariables], str]:
    """Local: the library's message counters (:data:`MESSAGES`), per rank of ``MPI.COMM_WORLD``, and a sentence on
    how messages are counted (``"messages counted by ..."``, ``"messages not counted: ..."``).

    Open MPI's monitoring answers for ``MPI_COMM_WORLD`` only; its counts
    cover the messages of every communicator. ``None`` where the counters
    cannot be read: Open MPI without its monitoring on, MPICH, or a tool
    interface that fails.
    """
    try:
        counters = PerformanceVariables(MESSAGES, MPI.COMM_WORLD)
    except OSError as exc:
        if library_version().startswith("Open MPI"):
            return (
                None,
                f"messages not counted: Open MPI's monitoring is off (start the job with {ENABLE_MONITORING}=1)",
            )
        return None, f"messages not counted: {library_version()} offers no message counters ({exc})"
    return counters, "messages counted by Open MPI's monitoring (MPI_T: " + " and ".join(MESSAGES) + ")"
