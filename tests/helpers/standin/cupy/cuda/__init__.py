"""Stand-in ``cupy.cuda``: devices, streams, events and pinned memory, modelled on the host.

Work is modelled as tickets: every operation on a device array takes the next
ticket of the calling thread's current stream; ``synchronize()`` completes
all tickets issued so far. ``Stream.wait_event`` makes a stream's completion
also complete the recorded work of the event's stream, as on a GPU. Nothing
completes by itself: only an explicit synchronisation (or a blocking copy to
the host) does, so a missing synchronisation is always visible.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from typing import Any, Optional

from cupy._ledger import LEDGER
from cupy.cuda import runtime

_local = threading.local()
_ptrs = itertools.count(0x1000)


def _device_count() -> int:
    return runtime.getDeviceCount()


# -- devices ---------------------------------------------------------------------------------
def current_device_id() -> int:
    """The calling thread's current device (0 until ``Device(i).use()``, as in CUDA)."""
    stack = getattr(_local, "devices", None)
    return stack[-1] if stack else getattr(_local, "device", 0)


class Device:
    """A CUDA device: ``Device(i).use()`` or ``with Device(i):`` makes it current in this thread."""

    def __init__(self, device: Any = None) -> None:
        self.id = current_device_id() if device is None else int(device)
        if not 0 <= self.id < _device_count():
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")

    def use(self) -> None:
        _local.device = self.id
        stack = getattr(_local, "devices", None)
        if stack:
            stack[-1] = self.id

    def synchronize(self) -> None:
        for stream in list(_streams):
            if stream.device_id == self.id:
                stream._complete_to(stream._issued)
        LEDGER.add("syncs")

    @property
    def compute_capability(self) -> str:
        return "90"

    def __enter__(self) -> Device:
        if not hasattr(_local, "devices"):
            _local.devices = []
        _local.devices.append(self.id)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.devices.pop()

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


# -- streams and events --------------------------------------------------------------------------
_streams: weakref.WeakSet[Stream] = weakref.WeakSet()
_null_streams: dict[int, Stream] = {}


class Stream:
    """A queue of work on one device. ``with stream:`` makes it current in this thread."""

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        self.device_id = current_device_id()
        self.is_null = null
        self.ptr = 0 if null else next(_ptrs)
        self._issued = 0
        self._completed = 0
        self._waits: list[tuple[int, Event]] = []  # (my ticket, event): completing it completes the event
        self._lock = threading.Lock()
        _streams.add(self)

    # the model
    def _issue(self) -> int:
        with self._lock:
            self._issued += 1
            return self._issued

    def _complete_to(self, ticket: int) -> None:
        with self._lock:
            if ticket <= self._completed:
                return
            self._completed = ticket
            due = [ev for t, ev in self._waits if t <= ticket]
            self._waits = [(t, ev) for t, ev in self._waits if t > ticket]
        for ev in due:
            if ev._stream is not None:
                ev._stream._complete_to(ev._ticket)

    def is_complete(self, ticket: int) -> bool:
        return self._completed >= ticket

    # the CuPy API
    def synchronize(self) -> None:
        """Wait for every operation queued so far."""
        self._complete_to(self._issued)
        LEDGER.add("syncs")

    @property
    def done(self) -> bool:
        return self._completed >= self._issued

    def record(self, event: Optional[Event] = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (no host blocking)."""
        ticket = self._issue()
        with self._lock:
            self._waits.append((ticket, event))

    def use(self) -> Stream:
        stack = _stream_stack(self.device_id)
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def __enter__(self) -> Stream:
        _stream_stack(self.device_id).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stream_stack(self.device_id).pop()

    def __repr__(self) -> str:
        return f"<Stream {'null' if self.is_null else hex(self.ptr)} (device {self.device_id})>"


def _null_stream(device_id: int) -> Stream:
    stream = _null_streams.get(device_id)
    if stream is None:
        with Device(device_id):
            stream = _null_streams.setdefault(device_id, Stream(null=True))
    return stream


def _stream_stack(device_id: int) -> list:
    stacks = getattr(_local, "streams", None)
    if stacks is None:
        stacks = _local.streams = {}
    return stacks.setdefault(device_id, [])


def get_current_stream(device_id: Optional[int] = None) -> Stream:
    """The calling thread's current stream on its current device (the null stream by default)."""
    device_id = current_device_id() if device_id is None else int(device_id)
    stack = _stream_stack(device_id)
    return stack[-1] if stack else _null_stream(device_id)


class Event:
    """A point in a stream's queue."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._stream: Optional[Stream] = None
        self._ticket = 0

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = get_current_stream() if stream is None else stream
        self._stream, self._ticket = stream, stream._issued

    @property
    def done(self) -> bool:
        return self._stream is None or self._stream.is_complete(self._ticket)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream._complete_to(self._ticket)
        LEDGER.add("syncs")


Stream.null = _null_stream(0)


# -- memory --------------------------------------------------------------------------------------
class MemoryPointer:
    """``array.data``: the address of a device array's first element."""

    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr = ptr
        self.device_id = device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)


class PinnedMemoryPointer(bytearray):
    """Page-locked host memory (here ordinary host memory); supports the buffer protocol."""

    @property
    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self)) if len(self) else 0


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    LEDGER.add("pinned_allocs")
    return PinnedMemoryPointer(int(size))


def is_available() -> bool:
    return _device_count() > 0
