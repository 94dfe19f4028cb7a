"""Where a rank's arrays live: NumPy on the host or CuPy on one GPU.

This is the only module that knows about GPUs. It chooses the array module,
binds a rank to one GPU by its node-local rank, synchronises the producing CUDA
stream before MPI reads a device buffer, and stages device buffers through
pinned host memory when MPI is not CUDA-aware. Nothing here communicates, and
nothing is probed at import time: CuPy is imported the first time a GPU
backend is asked for.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

    from mpidist._typing import Array

__all__ = [
    "Backend",
    "DeviceStager",
    "array_module",
    "contiguous",
    "cupy_or_none",
    "cupy_version",
    "data_pointer",
    "device_into_host",
    "host_bytes",
    "is_device_array",
    "nccl_status",
    "to_host",
]


def cupy_or_none() -> Optional[ModuleType]:
    """CuPy if it imports and sees at least one CUDA device, else ``None``."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # CUDA driver missing or broken: CuPy raises its own runtime errors.
        return None
    return cupy


_DEVICE_KINDS = frozenset({2, 10, 13})  # DLPack device types: CUDA, ROCm, CUDA managed memory


def is_device_array(array: Any) -> bool:
    """True for arrays in GPU memory (CuPy arrays, and other objects exposing ``__cuda_array_interface__``).

    Never reads the interface of a CuPy array: reading it is how consumers
    such as MPI take a device buffer (and it builds a dict per call). Asks
    ``__dlpack_device__`` instead, which objects that forward to a component
    (distributed values) answer for their component.
    """
    kind = type(array)
    if kind is np.ndarray or not hasattr(kind, "__cuda_array_interface__"):
        return False
    device = getattr(array, "__dlpack_device__", None)
    if device is not None:
        return device()[0] in _DEVICE_KINDS
    return hasattr(array, "__cuda_array_interface__")


def device_into_host(source: Any, target: Any) -> bool:
    """Whether ``source`` is a device array and ``target`` a host one, a pair no reduction takes.

    MPI would read the device buffer without its stream synchronisation, or get a device pointer
    when it is not CUDA-aware. Arrays of one class never are such a pair: callers on latency
    paths compare classes first.
    """
    return is_device_array(source) and not is_device_array(target)


def data_pointer(array: Array) -> int:
    """The address of ``array``'s first element, in host or device memory."""
    raw: Any = array  # CuPy's .data and NumPy's __array_interface__ are not members of Array
    if is_device_array(array):
        return int(raw.data.ptr)
    return int(raw.__array_interface__["data"][0])


def to_host(array: Any) -> np.ndarray:
    """A host NumPy array with ``array``'s data (a copy for device arrays, else a view).

    ``array`` is anything: a device array, or whatever ``numpy.asarray`` takes (user values too).
    """
    if is_device_array(array):
        return array.get()
    return np.asarray(array)


def host_bytes(array: Any, lo: int, hi: int) -> np.ndarray:
    """Local: bytes ``[lo, hi)`` of ``array`` (NumPy or a device array) as a host ``uint8`` array.

    Only that range is copied from a device, so a large device array never needs a whole host copy.
    """
    itemsize = array.dtype.itemsize
    part = to_host(array.reshape(-1)[lo // itemsize : hi // itemsize])
    return np.ascontiguousarray(part).view(np.uint8)


class Backend:
    """The array module of one rank and, on a GPU, the device it is bound to.

    Create with :meth:`select`. Local: nothing here talks to other ranks.
    """

    def __init__(self, xp: ModuleType, device_id: Optional[int] = None) -> None:
        self.xp = xp
        self.device_id = device_id
        self._pinned: dict[tuple[int, str], np.ndarray] = {}

    @property
    def name(self) -> str:
        """``"numpy"`` or ``"cupy"``."""
        return self.xp.__name__

    @property
    def is_gpu(self) -> bool:
        return self.device_id is not None

    def __repr__(self) -> str:
        where = f"cuda:{self.device_id}" if self.is_gpu else "host"
        return f"Backend({self.name}, {where})"

    @classmethod
    def select(cls, device: str = "auto", local_rank: int = 0) -> Backend:
        """Choose NumPy or CuPy and bind this rank's GPU.

        Args:
            device: ``"cpu"``, ``"gpu"`` (CuPy required) or ``"auto"`` (CuPy
                when it sees a GPU, else NumPy).
            local_rank: this rank's index among the ranks on its node; the
                rank uses GPU ``local_rank % visible GPUs``. ``CUDA_VISIBLE_DEVICES``
                is honoured because CUDA numbers only the visible devices.
        """
        if device == "cpu":
            return cls(np)
        cupy = cupy_or_none()
        if cupy is None:
            if device == "gpu":
                raise RuntimeError(
                    "device='gpu' needs CuPy and a visible CUDA device "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                    "install CuPy for your CUDA version (pip install 'mpidist[cuda12]' or 'mpidist[cuda13]') "
                    "or use device='cpu'"
                )
            return cls(np)
        count = cupy.cuda.runtime.getDeviceCount()
        device_id = local_rank % count
        cupy.cuda.Device(device_id).use()
        return cls(cupy, device_id)

    def device_info(self) -> Optional[dict[str, Any]]:
        """Name, PCI bus id and visible-device count of this rank's GPU; ``None`` on the host."""
        if not self.is_gpu:
            return None
        runtime = self.xp.cuda.runtime
        props = runtime.getDeviceProperties(self.device_id)
        name = props.get("name", b"?")
        return {
            "device": self.device_id,
            "name": name.decode(errors="replace") if isinstance(name, bytes) else str(name),
            "pci_bus_id": runtime.deviceGetPCIBusId(self.device_id),
            "visible": runtime.getDeviceCount(),
        }

    # -- arrays -----------------------------------------------------------------
    def asarray(self, value: Any, dtype: Optional[DTypeLike] = None) -> Any:
        """``value`` as an array of this backend (copies across host/device only)."""
        return self.xp.asarray(value, dtype=dtype)

    # -- handing buffers to MPI -------------------------------------------------
    @staticmethod
    def synchronize() -> None:
        """Wait for the current CUDA stream, so MPI reads finished data."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    def _pinned_like(self, array: Array, reuse: bool) -> np.ndarray:
        """A page-locked host buffer with ``array``'s shape and dtype (cached when ``reuse``)."""
        import cupyx

        key = (array.size, array.dtype.str)
        buf = self._pinned.get(key) if reuse else None
        if buf is None:
            buf = cupyx.empty_pinned((array.size,), dtype=array.dtype)
            if reuse:
                self._pinned[key] = buf
        return buf.reshape(array.shape)

    @staticmethod
    def needs_staging(array: Array, cuda_aware: bool) -> bool:
        """Whether MPI needs a host copy of ``array`` (a device array, MPI not CUDA-aware)."""
        return is_device_array(array) and not cuda_aware

    def to_mpi(self, array: Array, cuda_aware: bool, reuse: bool = True) -> Array:
        """A buffer MPI may use in place of ``array``.

        Host arrays are returned as they are. Device arrays are returned as
        they are after a stream synchronisation when MPI is CUDA-aware;
        otherwise their data is copied into a pinned host buffer (reused
        between calls when ``reuse``; pass ``reuse=False`` for buffers that
        stay in flight, as in nonblocking calls).

        The one place that makes device buffers ready for MPI: a device array
        reaches MPI only after this ran for it, or for the other buffer of the
        same call (the synchronisation covers the whole stream); only host
        arrays go to MPI directly.
        """
        if not is_device_array(array):
            return array
        self.synchronize()
        if not self.needs_staging(array, cuda_aware):
            return array
        host = self._pinned_like(array, reuse)
        device: Any = array  # a CuPy array here: .get() is not a member of Array
        device.get(out=host)
        return host

    def from_mpi(self, array: Array, buffer: Array) -> None:
        """Copy what MPI wrote into ``buffer`` (from :meth:`to_mpi`) back into ``array``."""
        if buffer is not array:
            device: Any = array  # a staged CuPy array: .set() is not a member of Array
            device.set(buffer)
            self.synchronize()


class DeviceStager:
    """Copies host arrays to a GPU backend's device on a side CUDA stream, ahead of their use.

    Made for input prefetching. Create it in the thread that will use the
    data (its current stream is the *consumer* stream). :meth:`start` may run
    in any thread: it copies the host array into pinned memory and queues an
    asynchronous host-to-device copy on the side stream. :meth:`finish` runs
    in the consumer's thread and makes the consumer stream wait for that copy
    without blocking the host. Local: nothing here talks to other ranks.

    Device buffers are allocated on the consumer stream, so CuPy's memory
    pool hands a freed batch's memory back to that stream only; the side
    stream waits for the consumer's queued work before it overwrites a
    reused block. Pinned host buffers are kept alive until their copy has
    completed.
    """

    def __init__(self, backend: Backend) -> None:
        if not backend.is_gpu:
            raise ValueError(f"DeviceStager needs a GPU backend, got {backend!r}")
        import cupy

        self._device_id = backend.device_id
        self._consumer = cupy.cuda.get_current_stream()
        with cupy.cuda.Device(self._device_id):
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._in_flight: list[tuple[Any, np.ndarray]] = []

    def start(self, host: ArrayLike) -> tuple[Any, Any]:
        """Queue the copy of ``host`` (a NumPy array) to the device; returns a token for :meth:`finish`."""
        import cupy
        import cupyx

        self._in_flight = [(ev, buf) for ev, buf in self._in_flight if not ev.done]
        host = np.asarray(host)
        pinned = cupyx.empty_pinned(host.shape, dtype=host.dtype)
        pinned[...] = host
        with cupy.cuda.Device(self._device_id):
            with self._consumer:
                device = cupy.empty(host.shape, dtype=host.dtype)
                allocated = cupy.cuda.Event(disable_timing=True)
                allocated.record(self._consumer)
            self._stream.wait_event(allocated)
            device.set(pinned, stream=self._stream)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(self._stream)
        self._in_flight.append((done, pinned))
        return device, done

    @staticmethod
    def finish(token: tuple[Any, Any]) -> Any:
        """The device array of ``token``; the calling thread's current stream waits for its copy."""
        import cupy

        device, done = token
        cupy.cuda.get_current_stream().wait_event(done)
        return device


def cupy_version() -> Optional[str]:
    """CuPy's version, ``"broken (...)"`` when it fails to import, ``None`` when not installed."""
    try:
        import cupy
    except ImportError:
        return None
    except Exception as exc:  # a CuPy whose CUDA libraries are missing raises its own errors
        return f"broken ({type(exc).__name__})"
    return str(cupy.__version__)


def nccl_status() -> str:
    """Whether CuPy's NCCL bindings are usable, in words (for reports)."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return "not available (CuPy is not installed)"
    except Exception as exc:  # CuPy present but its CUDA libraries are not: report, don't fail
        return f"not available ({type(exc).__name__}: {exc})"
    if not getattr(nccl, "available", False):
        return "not available (this CuPy was built without NCCL)"
    try:
        v = nccl.get_version()
    except Exception:  # older CuPy without get_version
        return "available"
    return f"available (NCCL {v // 10000}.{v // 100 % 100}.{v % 100})" if v >= 10000 else f"available (NCCL {v})"


def contiguous(array: Array) -> Array:
    """``array`` itself when C-contiguous, else a C-contiguous copy (0-d arrays stay 0-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def array_module(array: Array) -> ModuleType:
    """``numpy`` or ``cupy``, whichever module ``array`` belongs to."""
    if is_device_array(array):
        import cupy

        return cupy
    return np
