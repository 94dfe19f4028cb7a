"""Where a rank's arrays live: NumPy on the host or CuPy on one GPU.

This is the only module that knows about GPUs. It chooses the array module,
binds a rank to one GPU by its node-local rank, converts other libraries'
arrays (torch, JAX, array-API libraries: DLPack or ``__array__``) into NumPy or
CuPy views of the same memory, synchronises the producing CUDA stream before
MPI reads a device buffer, and stages device buffers through pinned host memory
when MPI is not CUDA-aware. Nothing here communicates, and nothing is probed at
import time: CuPy is imported the first time a GPU backend (or an array in GPU
memory) is asked for.
"""

from __future__ import annotations

import ctypes
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from mpidist._errors import on_rank

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

    from mpidist._typing import Array

__all__ = [
    "HALF_FLOATS",
    "Backend",
    "DeviceStager",
    "array_module",
    "as_array",
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

# The dtype chars of the 16-bit floats, float16 and bfloat16 (ml_dtypes' user dtype, char 'E'), which MPI
# gets as their bit patterns: MPI has no bfloat16, and not every MPI has float16. Collectives that combine
# values reduce them through float32 (mpidist._comm.half), never as these bits.
HALF_FLOATS = frozenset("eE")


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


def as_array(value: Any, what: str = "value", rank: Optional[int] = None) -> Any:
    """Local: another library's array as a NumPy or CuPy array of the same memory; anything else as it is.

    - NumPy and CuPy arrays, NumPy scalars, Python numbers and lists, and objects with neither
      protocol below are returned as they are (callers convert numbers and lists, or refuse them).
    - An object with ``__dlpack__`` (torch, JAX, array-API libraries, ...) becomes a view without a
      copy: ``numpy.from_dlpack`` for host memory, ``cupy.from_dlpack`` for GPU memory (which
      hands the current CUDA stream to the exporter). Writing into the view writes into
      ``value``. A bfloat16 tensor, which NumPy (and CuPy before 14) cannot import, becomes an
      ``ml_dtypes.bfloat16`` view of the same memory (:func:`_bfloat16_view`). A host array whose
      library refuses the export (a dtype DLPack lacks, a tensor that requires grad) is read
      through its ``__array__`` when it has one.
    - An object with only ``__array__`` becomes ``numpy.asarray(value)`` (a view where the
      library gives one).

    What the other library raises is raised as it is (callers route it into the agreement, as
    any failure of a rank's argument). An array in GPU memory without CuPy, and a bfloat16 one
    that this CuPy cannot hold, raise ``TypeError`` naming ``what`` and ``rank``.
    """
    kind = type(value)
    if kind is np.ndarray or not (hasattr(kind, "__dlpack__") or hasattr(kind, "__array__")):
        return value
    if isinstance(value, (np.ndarray, np.generic)) or _is_cupy_array(value):
        return value
    if not hasattr(kind, "__dlpack__"):
        return np.asarray(value)
    exporter = getattr(value, "__dlpack_device__", None)
    device = 1 if exporter is None else exporter()[0]  # without a device: the host (kDLCPU)
    if device in _DEVICE_KINDS:
        cupy = _cupy_for(value, device, what, rank)
        try:
            return cupy.from_dlpack(value)
        except Exception:  # a dtype this CuPy does not import: bfloat16's bits, if it is that
            view = _bfloat16_view(value, cupy.from_dlpack, what, rank)
            if view is None:
                raise
            return view
    try:
        return np.from_dlpack(value)
    except Exception:  # bfloat16's bits; or the library refuses DLPack (BufferError, ...): its __array__, if any
        view = _bfloat16_view(value, np.from_dlpack, what, rank)
        if view is not None:
            return view
        if not hasattr(kind, "__array__"):
            raise
        return np.asarray(value)


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """The head of DLPack's ``DLTensor``, up to its dtype (what :func:`_relabel_bfloat16` reads)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
    ]


class _DLManagedTensorVersioned(ctypes.Structure):
    """The head of DLPack 1's ``DLManagedTensorVersioned`` (capsule ``"dltensor_versioned"``), up to its tensor."""

    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_KDL_UINT, _KDL_BFLOAT = 1, 4  # DLPack dtype codes


def _relabel_bfloat16(capsule: Any) -> bool:
    """Local: whether ``capsule`` (a DLPack capsule not yet consumed) holds a bfloat16 tensor, which it then
    labels as ``uint16``: the same bits, in the same memory, for an importer that has no bfloat16.

    A ``"dltensor"`` capsule points to a ``DLManagedTensor``, whose first member is the tensor; a
    ``"dltensor_versioned"`` one to a ``DLManagedTensorVersioned``.
    """
    name = _capsule_name(capsule)
    if name not in (b"dltensor", b"dltensor_versioned"):
        return False
    address = _capsule_pointer(capsule, name)
    tensor = (
        _DLTensor.from_address(address)
        if name == b"dltensor"
        else _DLManagedTensorVersioned.from_address(address).dl_tensor
    )
    dtype = tensor.dtype
    if (dtype.code, dtype.bits, dtype.lanes) != (_KDL_BFLOAT, 16, 1):
        return False
    dtype.code = _KDL_UINT
    return True


class _NotBfloat16(Exception):
    """Raised through an importer when the tensor :class:`_AsBits` was asked to export is not bfloat16."""


class _AsBits:
    """A bfloat16 DLPack exporter seen as one of ``uint16`` (:func:`_relabel_bfloat16`); any other dtype is refused."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __dlpack_device__(self) -> Any:
        return self.value.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        capsule = self.value.__dlpack__(**kwargs)  # the importer's own arguments (its stream, its DLPack version)
        if not _relabel_bfloat16(capsule):
            raise _NotBfloat16
        return capsule


def _bfloat16_view(value: Any, importer: Any, what: str, rank: Optional[int]) -> Any:
    """Local: ``value``'s bfloat16 tensor as an ``ml_dtypes.bfloat16`` view of the same memory, imported by
    ``importer`` (``numpy.from_dlpack`` or ``cupy.from_dlpack``) as its ``uint16`` bits; ``None`` when
    ``value`` is not bfloat16. A ``TypeError`` naming ``what`` and ``rank`` when ml_dtypes is not
    installed, or the array module cannot hold bfloat16 (CuPy before 14)."""
    try:
        bits = importer(_AsBits(value))
    except _NotBfloat16:
        return None
    except Exception:  # the exporter or importer failed on the relabelled tensor as well: not ours to explain
        return None
    try:
        import ml_dtypes
    except ImportError as exc:
        raise TypeError(
            on_rank(rank, f"{what} is a bfloat16 tensor, which needs ml_dtypes (pip install 'mpidist[bfloat16]')")
        ) from exc
    try:
        return bits.view(ml_dtypes.bfloat16)
    except Exception as exc:  # an array module without bfloat16
        module = type(bits).__module__.split(".")[0]
        version = getattr(sys.modules.get(module), "__version__", "?")
        raise TypeError(
            on_rank(
                rank,
                f"{what} is a bfloat16 tensor in GPU memory, which {module} {version} cannot hold (CuPy has "
                "bfloat16 from version 14, with ml_dtypes); update CuPy, or convert it to float32 first",
            )
        ) from exc


def _is_cupy_array(value: Any) -> bool:
    """Whether ``value`` is a CuPy array (without importing CuPy: none exists before it is imported)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def _cupy_for(value: Any, device: int, what: str, rank: Optional[int]) -> ModuleType:
    """CuPy, to import ``value`` (``what`` in messages) from GPU memory (DLPack device type ``device``)."""
    try:
        import cupy
    except ImportError as exc:
        kind = type(value)
        raise TypeError(
            on_rank(
                rank,
                f"{what}: the {kind.__module__}.{kind.__qualname__} lies in GPU memory (DLPack device type "
                f"{device}), which needs CuPy (pip install 'mpidist[cuda12]' or 'mpidist[cuda13]'); "
                "or copy it to the host first",
            )
        ) from exc
    return cupy


def device_into_host(source: Any, target: Any) -> bool:
    """Whether ``source`` is a device array and ``target`` a host one, a pair no reduction takes.

    MPI would read the device buffer without its stream synchronisation, or get a device pointer
    when it is not CUDA-aware. Arrays of one class never are such a pair: callers on latency
    paths compare classes first.
    """
    return is_device_array(source) and not is_device_array(target)


def data_pointer(array: Array) -> int:
    """The address of ``array``'s first element, in host or device memory."""
    # CuPy's .data and NumPy's __array_interface__ are not members of Array. Another library's
    # array is read through its NumPy or CuPy view (the same memory), never through its own .data
    raw: Any = array if array.__class__ is np.ndarray else as_array(array)
    if is_device_array(raw):
        return int(raw.data.ptr)
    return int(raw.__array_interface__["data"][0])


def to_host(array: Any) -> np.ndarray:
    """A host NumPy array with ``array``'s data (a copy for device arrays, else a view).

    ``array`` is anything: a device array, another library's array (:func:`as_array`), or
    whatever ``numpy.asarray`` takes (user values too).
    """
    array = as_array(array)
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
    def asarray(
        self, value: Any, dtype: Optional[DTypeLike] = None, what: str = "value", rank: Optional[int] = None
    ) -> Any:
        """``value`` as an array of this backend (copies across host/device only).

        Other libraries' arrays are read through :func:`as_array` (without a copy where they
        share this backend's memory); ``what`` and ``rank`` name the value in its errors.
        """
        return self.xp.asarray(as_array(value, what, rank), dtype=dtype)

    def array(
        self, value: Any, dtype: Optional[DTypeLike] = None, what: str = "value", rank: Optional[int] = None
    ) -> Any:
        """A new C-contiguous array of this backend with ``value``'s data: always a copy.

        ``value`` is an array of any library (:func:`as_array`; ``what`` and ``rank`` name it
        in its errors), a number or a (nested) list; a device array's data is copied to the
        host for a NumPy backend.
        """
        source = as_array(value, what, rank)
        return self.xp.array(source if self.is_gpu else to_host(source), dtype=dtype, order="C", copy=True)

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
        stay in flight, as in nonblocking calls). A 16-bit float array
        (:data:`HALF_FLOATS`) comes back as its bit patterns, a ``uint16``
        view (staged as such), which MPI moves as it is: neither NumPy's
        buffer protocol nor DLPack can hand MPI a bfloat16 buffer.

        The one place that makes device buffers ready for MPI: a device array
        reaches MPI only after this ran for it, or for the other buffer of the
        same call (the synchronisation covers the whole stream); only host
        arrays go to MPI directly.
        """
        if not is_device_array(array):
            return array if array.dtype.char not in HALF_FLOATS else array.view(np.uint16)
        self.synchronize()
        if array.dtype.char in HALF_FLOATS:
            array = array.view(np.uint16)
        if not self.needs_staging(array, cuda_aware):
            return array
        host = self._pinned_like(array, reuse)
        device: Any = array  # a CuPy array here: .get() is not a member of Array
        device.get(out=host)
        return host

    def from_mpi(self, array: Array, buffer: Array) -> None:
        """Copy what MPI wrote into ``buffer`` (from :meth:`to_mpi`) back into ``array``, if it was staged."""
        if buffer is not array and is_device_array(array) and not is_device_array(buffer):
            # a staged CuPy array (.set() is not a member of Array), as the bits to_mpi staged
            device: Any = array if array.dtype.char not in HALF_FLOATS else array.view(np.uint16)
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
