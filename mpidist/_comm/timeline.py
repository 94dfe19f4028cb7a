"""The timeline: every rank streams a Chrome-trace (Perfetto) file of its collectives, steps and input.

With ``options.timeline`` set to a directory, each rank writes
``timeline-rank<R>.json`` there (``R``: its rank in ``MPI.COMM_WORLD``) while
the job runs. ``python -m mpidist timeline DIR`` (:mod:`mpidist._tools.timeline`)
merges the files, aligns the ranks' clocks and says which rank the others
waited for.

Recording is installed when a communicator is created with the option, and
only then: its transport and agreement are then of the recording subclasses
:class:`TimedTransport` and :class:`TimedAgreement`, its nonblocking
collectives are wrapped (:meth:`Track.record_nonblocking`), and the strategy and
the input iterators wrap their steps and fetches (:meth:`Timeline.timed`).
Without the option nothing of this module runs per call.

Recording a collective costs two clock readings and a list extended by its
numbers, in the agreement. The records are turned into JSON lines (one
``%``-format of a cached template each) in batches of :data:`BATCH` records,
and by a background thread after :data:`QUIET` seconds without a batch, then
written and flushed: memory stays bounded, and a killed job leaves all but
its last fraction of a second.

The file is the JSON array form of the Trace Event Format, one event per line,
each line ending with a comma; the closing ``]`` is written at exit (trace
viewers read a file without it, and the merge skips a line that a killed
process cut short). Times are ``time.perf_counter()`` in whole microseconds:
one clock per machine, which the merge aligns across machines. The events:

- metadata (``"ph": "M"``): the process (``pid``: the world rank) and its
  tracks (``tid``): 0 for steps, input and handles' waits, 1, 2, ... for the communicators in
  the order this rank created them, with their rank and size in ``args`` (and ``world``, for
  a communicator over every rank: its number among those, alike on every rank);
- ``"timeline"`` (an instant at the start): rank, size, host, the wall-clock
  time and the trace clock at the same moment, and the job's identity
  (``job``: alike on every rank of the job, see :func:`number_communicator`);
- a collective: its agreement, an event of category ``"wait"`` (the rank
  waited there for the others) named by the call (``allreduce(mean) of 'w1'
  float32[64, 64]``), with ``kind``, ``name``, ``bytes`` and ``seq`` (the
  collective number) in ``args``; right after it, when data moved after the
  agreement (a reduction too large to ride in the agreement's own record), an
  event ``"transfer"`` (category ``"transfer"``, the same ``seq``) up to the
  end of the data transfer. With every check off there is no agreement: the
  collective is its ``"transfer"`` event alone. A nonblocking
  collective's agreement has category ``"in flight"`` (from its start to the
  agreement's completion: the rank may compute meanwhile), and its handle's
  ``wait()`` is an event of category ``"handle"`` on track 0 (``args.seq``);
- ``"step"`` events (category ``"step"``, ``args.step``) for each
  ``strategy.run``, and ``"next(iterator)"`` events (category ``"input"``)
  for each step drawn from an mpidist input iterator.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import math
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._comm.abort import call_before_abort, install_exit_hook
from mpidist._comm.agreement import BFLOAT16, Agreement, Call, Kind
from mpidist._comm.transport import Transport
from mpidist._options import Options
from mpidist._version import __version__

if TYPE_CHECKING:
    from mpidist._comm.agreement import CallData, Ticket, _Plan
    from mpidist._comm.handle import Handle

__all__ = [
    "BATCH",
    "FILE_PATTERN",
    "NONBLOCKING",
    "QUIET",
    "TimedAgreement",
    "TimedTransport",
    "Timeline",
    "Track",
    "number_communicator",
    "open_timeline",
]

BATCH = 4096  # records turned into JSON and written at once
QUIET = 0.5  # seconds without a batch after which the background thread writes what was recorded
FILE_PATTERN = "timeline-rank{rank}.json"
# The communicator's nonblocking collectives: each returns a Handle whose wait() is recorded.
NONBLOCKING = ("iallreduce", "iallreduce_many", "iallgather", "ialltoall", "ibroadcast", "ireduce_scatter")
_STEPS_TID = 0
_CACHED = 4096  # event formats kept per track (the cache is emptied when it grows past this)

_perf_counter = time.perf_counter
_agree_planned = Agreement.agree_planned  # what TimedAgreement.agree_planned adds to, without a lookup per call
# A collective's record: its call, its number, the start and end of its agreement, the end of the last transfer
# before it began.
_FIELDS = 5
_BATCH_ITEMS = BATCH * _FIELDS
_open: dict[str, Timeline] = {}  # by absolute directory
_world_communicators = itertools.count(1)  # numbers of the communicators over every rank (number_communicator)
_job: Optional[str] = None  # the job's identity, alike on every rank: set with the first communicator over every rank


def number_communicator(comm: MPI.Intracomm) -> Optional[int]:
    """For every mpidist communicator this process creates, with a timeline or without: ``comm``'s number among
    the communicators over every rank, which is the same on every rank (each takes part in creating each of
    them), or ``None`` when it is smaller. The merge matches the ranks' tracks by it, also where ranks recorded
    different communicators (the option is local).

    Collective over the first communicator over every rank (one small broadcast), local otherwise: there the
    ranks take its rank 0's host, process id and clock as the job's identity, which every rank's timeline
    writes in its header, so that the merge can tell the files of this job from those an earlier job of as many
    ranks left in the directory. A timeline opened before (on a smaller communicator) is written without it.
    """
    global _job
    if comm.size != MPI.COMM_WORLD.size:
        return None
    number = next(_world_communicators)
    if number == 1:
        _job = comm.bcast(f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}" if comm.rank == 0 else None)
    return number


def open_timeline(directory: str) -> Timeline:
    """Local: this process's timeline in ``directory`` (opened, and its file created, on first use)."""
    key = os.path.abspath(directory)
    timeline = _open.get(key)
    if timeline is None:
        timeline = _open[key] = Timeline(key)
    return timeline


class Timeline:
    """One rank's timeline file and what is recorded but not yet written. Local.

    The recording code adds to containers that take an item in one step
    (thread-safe, no lock): the deque ``spans`` holds ``(category, tid, t0,
    t1, number)`` (steps, input fetches, handles' waits); each
    :class:`Track` holds its collectives.
    :meth:`drain` (under the lock) turns them into JSON lines and writes them.
    """

    def __init__(self, directory: str) -> None:
        world = MPI.COMM_WORLD
        self.rank, self.size = world.rank, world.size
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, FILE_PATTERN.format(rank=self.rank))
        self.spans: collections.deque[tuple[str, int, float, float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._tracks: list[Track] = []
        self._file = open(self.path, "wb")  # noqa: SIM115  # open until exit (close())
        self._write(
            b"[\n"
            + _json_line({"ph": "M", "pid": self.rank, "name": "process_name", "args": {"name": f"rank {self.rank}"}})
            + _json_line({"ph": "M", "pid": self.rank, "name": "process_sort_index", "args": {"sort_index": self.rank}})
            + _json_line(
                {
                    "ph": "M",
                    "pid": self.rank,
                    "tid": _STEPS_TID,
                    "name": "thread_name",
                    "args": {"name": "steps, input, waits for handles"},
                }
            )
            + _json_line(
                {
                    "ph": "i",
                    "s": "p",
                    "pid": self.rank,
                    "tid": _STEPS_TID,
                    "ts": int(_perf_counter() * 1e6),
                    "name": "timeline",
                    "args": {
                        "rank": self.rank,
                        "size": self.size,
                        "host": socket.gethostname(),
                        "process": os.getpid(),
                        "wall_time": time.time(),
                        "mpidist": __version__,
                        **({} if _job is None else {"job": _job}),
                    },
                }
            )
        )
        self._drained_at = _perf_counter()
        self._stop = threading.Event()
        # Exit hooks run last-registered first: this file is complete before mpidist's own exit hook runs
        # (which may end the process at once, os._exit, when a deadline passed on this rank).
        install_exit_hook()
        atexit.register(self.close)
        call_before_abort(self.close)
        self._thread = threading.Thread(target=self._write_when_quiet, name="mpidist timeline", daemon=True)
        self._thread.start()

    def track(self, rank: int, size: int, world: Optional[int] = None) -> Track:
        """Local: a new track (``tid``) for a communicator of ``size`` ranks in which this rank is ``rank``;
        ``world``: its number among the communicators over every rank (:func:`number_communicator`)."""
        with self._lock:
            track = Track(self, len(self._tracks) + 1)
            self._tracks.append(track)
            self._write(
                _json_line(
                    {
                        "ph": "M",
                        "pid": self.rank,
                        "tid": track.tid,
                        "name": "thread_name",
                        "args": {
                            "name": f"communicator {track.tid} (rank {rank} of {size})",
                            "communicator": track.tid,
                            "rank": rank,
                            "size": size,
                            **({} if world is None else {"world": world}),
                        },
                    }
                )
            )
        return track

    def timed(
        self, fn: Callable[..., Any], category: str, tid: int = _STEPS_TID, number: Optional[int] = None
    ) -> Callable[..., Any]:
        """Local: ``fn`` that records each call as a span of ``category`` on track ``tid``.

        Its ``args`` number the calls (1, 2, ...), or hold ``number`` when given (a collective's number).
        """
        spans = self.spans
        numbers = itertools.count(1) if number is None else itertools.repeat(number)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            t0 = _perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((category, tid, t0, _perf_counter(), next(numbers)))
                if len(spans) >= BATCH:
                    self.drain()

        return recorded

    def drain(self, final: bool = False) -> None:
        """Local: turn what was recorded into JSON lines and write them (flushed).

        A collective's transfer is written once the next collective on its
        track began, or once its track has been quiet for :data:`QUIET`
        seconds, or with ``final``.
        """
        with self._lock:
            if self._file.closed:
                self.spans.clear()
                for track in self._tracks:
                    del track.records[:]
                return
            lines = self._spans()
            now = _perf_counter()
            for track in self._tracks:
                lines += track.drain(now, final)
            self._file.write(b"".join(lines))
            self._file.flush()
            self._drained_at = now

    def close(self) -> None:
        """Local: write everything, end the JSON array and close the file (at exit; a second call does nothing)."""
        if self._file.closed:
            return
        self._stop.set()
        self.drain(final=True)
        with self._lock:
            end = {"ph": "i", "s": "p", "pid": self.rank, "tid": _STEPS_TID, "name": "timeline end"}
            self._write(
                json.dumps({**end, "ts": int(_perf_counter() * 1e6)}, separators=(",", ":")).encode() + b"\n]\n"
            )
            self._file.close()

    def _write(self, data: bytes) -> None:
        if data:
            self._file.write(data)
            self._file.flush()

    def _write_when_quiet(self) -> None:
        """The background thread: write what was recorded once the program recorded nothing for a while."""
        while not self._stop.wait(QUIET):
            if _perf_counter() - self._drained_at >= QUIET:
                try:
                    self.drain()
                except (OSError, ValueError):  # the file cannot be written any more (full disk, closed)
                    return

    def _spans(self) -> list[bytes]:
        """The JSON lines of the spans recorded so far (under the lock)."""
        spans, pop = self.spans, self.spans.popleft
        lines = []
        for _ in range(len(spans)):
            category, tid, t0, t1, number = pop()
            name, key = _SPANS[category]
            line = _format(self.rank, tid, category, name, "", key)
            lines.append(line % (t0 * 1e6, (t1 - t0) * 1e6 + 0.5, number))
        return lines


# Span categories: the event's name and the key of its number in args.
_SPANS = {"step": ("step", "step"), "input": ("next(iterator)", "step"), "handle": ("wait()", "seq")}


class Track:
    """One communicator's collectives on this rank's timeline (its ``tid``). Local.

    The recording code notes a collective with :meth:`note`: it extends
    ``records`` by ``(call, seq, t0, t1, data_end_before)`` (``call``
    ``None`` with every check off) in one step, atomic for the background
    thread, and the drain writes each as a line. ``nonblocking`` gets the numbers
    of nonblocking collectives as they start; ``data_end`` is when this rank's last
    data transfer on the communicator ended (:class:`TimedTransport` sets it).
    A collective's transfer lasts from the end of its agreement to the last
    transfer before the next collective began (``data_end_before`` of the next
    record).
    """

    def __init__(self, timeline: Timeline, tid: int) -> None:
        self.timeline, self.tid = timeline, tid
        self.records: list[Any] = []  # flat: _FIELDS items per collective
        self.nonblocking: collections.deque[int] = collections.deque()
        self.data_end = 0.0
        self.finished = False  # the communicator was freed
        self._seq = 0  # the last collective written
        self._t1 = 0.0  # the end of its agreement
        self._owed = False  # whether its transfer is still to be written
        self._owed_always = False  # ... even if no data moved (every check off: the transfer is the collective)
        self._unsettled: set[int] = set()  # nonblocking collectives started, not written yet
        self._formats: dict[Any, bytes] = {}  # by Call (identity) and by Call.key
        self._nonblocking_formats: dict[Any, bytes] = {}  # by Call.key
        self._transfer = _format(timeline.rank, tid, "transfer", "transfer", "")

    def record_nonblocking(self, start: Callable[..., Handle], transport: Transport) -> Callable[..., Handle]:
        """Local: the communicator's nonblocking method ``start``, recording that its collective is nonblocking
        and how long its handle's ``wait()`` blocks."""
        nonblocking, timeline = self.nonblocking, self.timeline

        def started(*args: Any, **kwargs: Any) -> Handle:
            handle = start(*args, **kwargs)
            seq = transport.seq
            nonblocking.append(seq)
            # the handle's own attribute: only this handle's wait() is recorded
            setattr(handle, "wait", timeline.timed(handle.wait, "handle", number=seq))  # noqa: B010
            return handle

        return started

    def note(self, call: Optional[Call], seq: int, t0: float, before: float) -> None:
        """Local: record collective ``seq`` (``call``), whose agreement began at ``t0`` and ended now, and the end of
        the last data transfer before it began."""
        records = self.records
        records += (call, seq, t0, _perf_counter(), before)
        if len(records) >= _BATCH_ITEMS:
            self.timeline.drain()

    def drain(self, now: float, final: bool) -> list[bytes]:
        """Local (under the timeline's lock): the JSON lines of the collectives recorded so far.

        The last collective's transfer is written when its track was freed or
        has been quiet for :data:`QUIET` seconds, or with ``final``.
        """
        items = len(self.records) // _FIELDS * _FIELDS  # first: every record counted began after its nonblocking start
        for _ in range(len(self.nonblocking)):
            seq = self.nonblocking.popleft()
            if seq > self._seq:  # else: written already (every check off: nothing to wait for)
                self._unsettled.add(seq)
        lines: list[bytes] = []
        if items:
            batch = self.records[:items]
            del self.records[:items]
            lines += self._collectives(batch)
        end = self.data_end
        if self._owed and not self.records and (final or self.finished or now - max(end, self._t1) >= QUIET):
            if end > self._t1 or self._owed_always:
                lines.append(self._transfer % (self._t1 * 1e6, (max(end, self._t1) - self._t1) * 1e6 + 0.5, self._seq))
            self._owed = False
        return lines

    def _collectives(self, batch: list[Any]) -> list[bytes]:
        """The JSON lines of a batch of records, and of the transfer owed by the last collective before them.

        A collective's transfer (when data moved after its agreement, or
        always when it had none) lasts from the end of its agreement to the
        last data transfer before the next collective began.
        """
        lines: list[bytes] = []
        append, transfer, unsettled, formats = lines.append, self._transfer, self._unsettled, self._formats
        seq0, end0, owed, always = self._seq, self._t1, self._owed, self._owed_always
        fields = iter(batch)
        for call, seq, t0, t1, before in zip(fields, fields, fields, fields, fields):
            if seq == seq0:  # recorded again by the call around it (agree_planned's slow path): the first is the one
                continue
            if owed and (before > end0 or always):
                append(transfer % (end0 * 1e6, (max(before, end0) - end0) * 1e6 + 0.5, seq0))
            if t0 < end0:  # it began inside the previous one's call (a pending agreement completed there)
                t0 = end0
            if t1 < t0:
                t1 = t0
            nonblocking = False
            if unsettled and seq in unsettled:
                unsettled.discard(seq)
                nonblocking = call is not None
            if call is not None:
                line = None if nonblocking else formats.get(call)
                if line is None:
                    line = self._format(call, nonblocking)
                append(line % (t0 * 1e6, (t1 - t0) * 1e6 + 0.5, seq))
            seq0, end0, owed, always = seq, t1, not nonblocking, call is None
        self._seq, self._t1, self._owed, self._owed_always = seq0, end0, owed, always
        return lines

    def _format(self, call: Call, nonblocking: bool) -> bytes:
        """The JSON line, as a ``%``-format of its times and number, of a collective like ``call``'s agreement.

        Cached by the call object (the per-collective path reuses its calls) and by what the call is
        (nonblocking ones by what they are only).
        """
        formats = self._nonblocking_formats if nonblocking else self._formats
        found = formats.get(call.key)
        if found is None:
            kind = "fused" if call.kind == Kind.FUSED else call.kind.name.lower()
            args = f'"kind":{json.dumps(kind)},"name":{json.dumps(call.name)},"bytes":{call_bytes(call)},'
            category = "in flight" if nonblocking else "wait"
            found = _format(self.timeline.rank, self.tid, category, _title(call), args)
        if len(formats) > _CACHED:
            formats.clear()
        formats[call.key] = found
        if not nonblocking:
            formats[call] = found
        return found


def _title(call: Call) -> str:
    """The event's name: what the call does (its description, without the update a reduction applies)."""
    text = call.describe()
    if call.extra and call.kind in (Kind.ALLREDUCE, Kind.BROADCAST, Kind.FUSED):
        update = f" then {call.extra[-1]}"
        if text.endswith(update):
            return text[: -len(update)]
    return text


def _format(pid: int, tid: int, category: str, title: str, args: str, key: str = "seq") -> bytes:
    """The JSON line of an event (``"ph": "X"``) of ``category`` named ``title``, as a ``%``-format of its start
    and duration in microseconds (floats, written as whole numbers: the start rounded down, the duration rounded
    when 0.5 is added) and its number ``args[key]``; ``args`` holds the other arguments, JSON members each followed
    by a comma."""
    head = f'{{"ph":"X","cat":"{category}","pid":{pid},"tid":{tid},"ts":'
    tail = f',"name":{json.dumps(title)},"args":{{{args}"{key}":'
    return (head.replace("%", "%%") + '%d,"dur":%d' + tail.replace("%", "%%") + "%d}},\n").encode()


def call_bytes(call: Call) -> int:
    """Local: the bytes of this rank's arrays in ``call`` (0 for calls without arrays, such as a barrier)."""
    if call.kind == Kind.FUSED and call.extra:
        specs = call.extra[0]
        return sum(np.dtype(dtype).itemsize * math.prod(shape) for _, dtype, shape in specs)
    if not call.dtype:
        return 0
    itemsize = 2 if call.dtype == BFLOAT16 else np.dtype(call.dtype).itemsize
    return itemsize * math.prod(call.shape)


def _json_line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b",\n"


class TimedTransport(Transport):
    """A :class:`~mpidist._comm.transport.Transport` that notes when each data transfer ends on ``track``.

    With every check off (no agreement) it records each collective as it begins.
    """

    def __init__(self, comm: MPI.Intracomm, options: Options, track: Track) -> None:
        super().__init__(comm, options)
        self.track = track

    def run(self, what: str, mpi_name: str, *args: Any, comm: Optional[MPI.Intracomm] = None) -> None:
        """Collective: :meth:`Transport.run`, noting its end."""
        try:
            Transport.run(self, what, mpi_name, *args, comm=comm)
        finally:
            self.track.data_end = _perf_counter()

    def begin(self) -> int:
        """Local: :meth:`Transport.begin`, recording the collective (every check off: it has no agreement)."""
        t0 = _perf_counter()
        seq = Transport.begin(self)
        self.track.note(None, seq, t0, self.track.data_end)
        return seq

    def free(self) -> None:
        """Collective: :meth:`Transport.free`; the track's last collective is written."""
        Transport.free(self)
        self.track.finished = True
        self.track.timeline.drain()


class TimedAgreement(Agreement):
    """An :class:`~mpidist._comm.agreement.Agreement` that records each collective's agreement on ``track``."""

    def __init__(self, transport: Transport, track: Track) -> None:
        super().__init__(transport)
        self._track = track
        self._records = track.records
        self._started = (0.0, 0.0)  # (t0, data end before) of the last nonblocking agreement started

    def agree(
        self,
        call: Call,
        error: Optional[Exception] = None,
        data: CallData = None,
        check_finite: bool = False,
        carry: Optional[int] = None,
    ) -> Optional[np.ndarray]:
        """Collective: :meth:`Agreement.agree`, recorded."""
        t0, before = _perf_counter(), self._track.data_end
        out = Agreement.agree(self, call, error, data, check_finite, carry)
        self._note(call, t0, before)
        return out

    def agree_planned(self, plan: _Plan, data: Any, check_finite: bool = False) -> Optional[np.ndarray]:
        """Collective: :meth:`Agreement.agree_planned`, recorded (the per-collective path, kept short)."""
        track = self._track
        t0, before = _perf_counter(), track.data_end
        out = _agree_planned(self, plan, data, check_finite)
        records = self._records  # Track.note, spelled out on this path
        records += (plan[0], self.transport.seq, t0, _perf_counter(), before)
        if len(records) >= _BATCH_ITEMS:
            track.timeline.drain()
        return out

    def start(
        self,
        call: Call,
        error: Optional[Exception] = None,
        data: CallData = None,
        check_finite: bool = False,
        then: Optional[Callable[[Optional[np.ndarray]], Any]] = None,
        carry: Optional[int] = None,
    ) -> Ticket:
        """Collective: :meth:`Agreement.start`; :meth:`settle` records it."""
        t0, before = _perf_counter(), self._track.data_end
        ticket = Agreement.start(self, call, error, data, check_finite, then, carry)
        self._started = (t0, before)  # after: a pending agreement that completed in start() was recorded with its own
        return ticket

    def settle(self, ticket: Ticket) -> None:
        """Local: :meth:`Agreement.settle`, recorded."""
        Agreement.settle(self, ticket)
        self._note(ticket.call, *self._started)

    def _note(self, call: Call, t0: float, before: float) -> None:
        self._track.note(call, self.transport.seq, t0, before)
