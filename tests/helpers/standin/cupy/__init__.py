"""A CPU stand-in for CuPy, for tests only (see tests/helpers/standin/README.md).

Device arrays wrap a private NumPy array. They behave like CuPy's where
mpidist depends on it: no implicit conversion to the host, explicit and
counted copies, stream-ordered work whose synchronisation is checked when MPI
reads a buffer, one current device per thread.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _real_cupy() -> str | None:
    """Where the real CuPy is, looking past this stand-in on ``sys.path``."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("cupy", others)
    return None if spec is None else (spec.origin or str(spec.submodule_search_locations))


_found = _real_cupy()
if _found is not None:
    raise ImportError(
        f"the CuPy stand-in in {_HERE} refuses to shadow the real CuPy at {_found}: "
        "unset MPIDIST_TEST_DEVICE=standin to test with the real CuPy"
    )

import builtins as _builtins  # noqa: E402
import ctypes  # noqa: E402
import numbers  # noqa: E402
import operator  # noqa: E402
import threading  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402

from cupy import cuda  # noqa: E402
from cupy._ledger import LEDGER  # noqa: E402
from cupy.cuda import current_device_id, get_current_stream  # noqa: E402

__version__ = "13.6.0+standin"
is_standin = True

_UNSUPPORTED = "Unsupported type {}"
_importing = threading.local()  # set while the stand-in itself imports a device buffer
_SCALARS = (numbers.Number, np.generic, str, bytes, type(None), slice, type(Ellipsis))


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _bounds(a: np.ndarray) -> tuple[int, int]:
    low = high = _address(a)
    for n, s in zip(a.shape, a.strides):
        if n == 0:
            return low, low
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return low, high + a.itemsize


class ndarray:
    """A device array: a private NumPy array on a stand-in device."""

    __slots__ = ("_a", "_base", "_device", "_pending", "__weakref__")
    __array_priority__ = 100.0

    def __init__(self, shape: Any, dtype: Any = float, order: str = "C") -> None:
        _init(self, np.empty(shape, dtype=dtype, order=order), None, current_device_id())

    # -- bookkeeping ------------------------------------------------------------------------
    def _root(self) -> ndarray:
        return self if self._base is None else self._base

    def _wrote(self, region: Optional[np.ndarray] = None, stream: Any = None) -> None:
        """Record work writing ``region`` (default: all of this array) on ``stream`` (default: current)."""
        stream = get_current_stream() if stream is None else stream
        ticket = stream._issue()
        lo, hi = _bounds(self._a if region is None else region)
        root = self._root()
        pending = root._pending
        if len(pending) > 16:
            pending[:] = [p for p in pending if not p[2].is_complete(p[3])]
        pending.append((lo, hi, stream, ticket))

    def _unfinished(self) -> list:
        """Pending work writing this array's memory."""
        lo, hi = _bounds(self._a)
        return [p for p in self._root()._pending if p[0] < hi and lo < p[1] and not p[2].is_complete(p[3])]

    def _check_device(self) -> None:
        current = current_device_id()
        if self._device != current:
            raise ValueError(
                f"The device where the array resides ({self._device}) is different from the "
                f"current device ({current}). Peer access is unavailable."
            )

    def _handed_out(self, how: str) -> None:
        """A consumer (MPI) reads the memory now: its producing work must be finished."""
        LEDGER.add("mpi_reads")
        for _, _, stream, ticket in self._unfinished():
            LEDGER.violation(
                f"{how} of a {self.dtype}{list(self.shape)} device array while {stream!r} had "
                f"unfinished work writing it (ticket {ticket}, completed {stream._completed}): "
                "the producing stream was not synchronised"
            )

    # -- attributes -------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    base = property(lambda self: self._base)
    device = property(lambda self: cuda.Device(self._device))
    data = property(lambda self: cuda.MemoryPointer(_address(self._a), self._device))
    T = property(lambda self: self.transpose())

    def _exported(self, how: str) -> None:
        if getattr(_importing, "on", False):  # CuPy itself consumes it (and honours the stream)
            _importing.owner = self
        else:
            self._handed_out(how)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self._exported("__cuda_array_interface__")
        stream = get_current_stream()
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": [("", self.dtype.str)],
            "data": (_address(self._a), False),
            "version": 3,
            "strides": None if self._a.flags.c_contiguous else self.strides,
            "stream": 1 if stream.is_null else stream.ptr,
        }

    def __dlpack__(
        self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None
    ) -> Any:
        self._exported(f"__dlpack__(stream={stream})")
        kwargs = {}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if copy is not None:
            kwargs["copy"] = copy
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return 2, self._device  # kDLCUDA

    # -- no implicit host conversion ----------------------------------------------------------
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        LEDGER.implicit_conversion(f"__array__ of a {self.dtype}{list(self.shape)} device array")
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method != "__call__" or _builtins.any(isinstance(x, np.ndarray) for x in inputs):
            return NotImplemented
        return _apply(ufunc, *inputs, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        mine = globals().get(func.__name__)
        if mine is None or not callable(mine):
            return NotImplemented
        return mine(*args, **kwargs)

    # -- explicit copies --------------------------------------------------------------------------
    def get(
        self, stream: Any = None, order: str = "C", out: Optional[np.ndarray] = None, blocking: bool = True
    ) -> np.ndarray:
        """A host copy (into ``out`` when given); waits for the stream's work, like CuPy."""
        stream = get_current_stream() if stream is None else stream
        stream._complete_to(stream._issued)
        for _, _, other, ticket in self._unfinished():
            LEDGER.violation(
                f"get() of a {self.dtype}{list(self.shape)} device array while {other!r} had "
                f"unfinished work writing it (ticket {ticket})"
            )
        LEDGER.copy("d2h", self.nbytes)
        if out is None:
            return self._a.copy(order=order)
        if not isinstance(out, np.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        if out.dtype != self.dtype:
            raise TypeError(f"dtype mismatch: out is {out.dtype}, array is {self.dtype}")
        if out.shape != self.shape:
            raise ValueError(f"Shape mismatch: out is {out.shape}, array is {self.shape}")
        if not (out.flags.c_contiguous or out.flags.f_contiguous):
            raise RuntimeError("Non-contiguous array is not supported yet.")
        np.copyto(out, self._a)
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Copy the host array ``arr`` into this array (queued on ``stream``, default current)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        LEDGER.copy("h2d", arr.nbytes)
        np.copyto(self._a, arr)
        self._wrote(stream=stream)

    def _scalar(self, convert: Callable[[Any], Any]) -> Any:
        get_current_stream()._complete_to(get_current_stream()._issued)
        LEDGER.add("scalar_reads")
        return convert(self._a)

    def __int__(self) -> int:
        return self._scalar(int)

    def __float__(self) -> float:
        return self._scalar(float)

    def __complex__(self) -> complex:
        return self._scalar(complex)

    def __bool__(self) -> bool:
        return self._scalar(bool)

    def item(self) -> Any:
        return self._scalar(lambda a: a.item())

    def tolist(self) -> Any:
        return self.get().tolist()

    def __repr__(self) -> str:  # for messages only: not counted
        return f"array({np.array2string(self._a, separator=', ')}, dtype={self.dtype}, device={self._device})"

    __str__ = __repr__

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self)))

    def __hash__(self) -> int:
        raise TypeError("unhashable type: 'cupy.ndarray'")

    # -- indexing ------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> ndarray:
        self._check_device()
        result = self._a[_key(key)]
        return _wrap(result, (self,))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._check_device()
        key = _key(key)
        if isinstance(value, ndarray):
            value._check_device()
            value = value._a
        elif isinstance(value, np.ndarray):
            LEDGER.copy("h2d", value.nbytes)
        self._a[key] = value
        region = self._a[key]
        self._wrote(region if isinstance(region, np.ndarray) and np.may_share_memory(region, self._a) else None)

    # -- methods -----------------------------------------------------------------------------
    def astype(
        self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None, copy: bool = True
    ) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _apply(lambda a: a.astype(dtype, order=order), self)

    def copy(self, order: str = "C") -> ndarray:
        return _apply(lambda a: a.copy(order=order), self)

    def fill(self, value: Any) -> None:
        self._check_device()
        self._a.fill(value)
        self._wrote()

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        return _apply(lambda a: a.reshape(*shape, order=order), self)

    def view(self, dtype: Any = None) -> ndarray:
        return _apply(lambda a: a.view() if dtype is None else a.view(dtype), self)

    # -- in-place operators ---------------------------------------------------------------------
    def _inplace(self, op: Callable[[Any, Any], Any], other: Any) -> ndarray:
        self._check_device()
        op(self._a, _unwrap(other))
        self._wrote()
        return self


def _init(obj: ndarray, a: np.ndarray, base: Optional[ndarray], device: int) -> ndarray:
    obj._a, obj._base, obj._device, obj._pending = a, base, device, []
    return obj


def _new(a: np.ndarray, base: Optional[ndarray] = None, device: Optional[int] = None) -> ndarray:
    return _init(ndarray.__new__(ndarray), a, base, current_device_id() if device is None else device)


def _consume(obj: Any, via: str = "__cuda_array_interface__", **kwargs: Any) -> Optional[ndarray]:
    """A device array viewing the memory ``obj`` exports (``None`` if it exports none), as CuPy imports it.

    ``kwargs`` go to ``obj.__dlpack__`` (the consumer's ``stream``).
    """
    _importing.on, _importing.owner = True, None
    try:
        exported = getattr(obj, via)
        if via == "__dlpack__":
            _refuse_bfloat16(exported(**kwargs))
    except AttributeError:
        return None
    finally:
        _importing.on = False
    owner = _importing.owner
    if owner is None:
        raise TypeError(f"{type(obj).__name__} exports {via} but not from a stand-in device array")
    return _new(owner._a.view(), owner._root(), owner._device)


_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _refuse_bfloat16(capsule: Any) -> None:
    """A bfloat16 DLPack tensor is refused, as CuPy 13 refuses it (and CuPy 14 did before it imported bfloat16
    through DLPack); arrays of ml_dtypes' bfloat16 work otherwise, as in CuPy 14.

    The dtype code is byte 20 of the ``DLTensor`` (after its data pointer, device and ndim), which starts
    a ``"dltensor"`` capsule's struct and lies 32 bytes into a ``"dltensor_versioned"`` one's.
    """
    name = _capsule_name(capsule)
    offset = {b"dltensor": 0, b"dltensor_versioned": 32}.get(name)
    if offset is not None and ctypes.c_uint8.from_address(_capsule_pointer(capsule, name) + offset + 20).value == 4:
        raise NotImplementedError("CuPy does not support bfloat16 yet")


def _unwrap(x: Any) -> Any:
    """The NumPy array inside a device array; NumPy arrays are refused, as CuPy refuses them."""
    if isinstance(x, ndarray):
        x._check_device()
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(_UNSUPPORTED.format(type(x)))
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    if not isinstance(x, _SCALARS) and not callable(x):
        imported = _consume(x)
        if imported is not None:
            return _unwrap(imported)
    return x


def _key(key: Any) -> Any:
    """An index: device index arrays unwrapped; host index arrays are copied to the device (counted)."""
    if isinstance(key, tuple):
        return tuple(_key(k) for k in key)
    if isinstance(key, ndarray):
        key._check_device()
        return key._a
    if isinstance(key, np.ndarray):
        LEDGER.copy("h2d", key.nbytes)
    return key


def _wrap(result: Any, inputs: tuple = (), out: Any = None) -> Any:
    """Wrap NumPy results as device arrays: views keep their base, new arrays are fresh work."""
    if isinstance(result, tuple):
        return tuple(_wrap(r, inputs) for r in result)
    if isinstance(result, list):
        return [_wrap(r, inputs) for r in result]
    if out is not None:
        out._wrote()
        return out
    if isinstance(result, np.generic):
        result = np.asarray(result)
    elif not isinstance(result, np.ndarray):
        return result
    if result.base is not None:
        for x in inputs:
            if isinstance(x, ndarray) and np.may_share_memory(result, x._a):
                return _new(result, x._root(), x._device)
    fresh = _new(result)
    fresh._wrote()
    return fresh


def _apply(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a NumPy function on device arrays (as a kernel on the current stream)."""
    out = kwargs.get("out")
    if isinstance(out, ndarray):
        kwargs["out"] = _unwrap(out)
    elif isinstance(out, tuple):
        raise TypeError("tuple out= is not supported by the stand-in")
    else:
        out = None
    flat = [a for a in args if isinstance(a, ndarray)] + [
        a for v in args if isinstance(v, (list, tuple)) for a in v if isinstance(a, ndarray)
    ]
    result = fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})
    return _wrap(result, tuple(flat), out)


def _binary(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[[ndarray, Any], Any]:
    def method(self: ndarray, other: Any) -> Any:
        if isinstance(other, np.ndarray):
            raise TypeError(_UNSUPPORTED.format(type(other)))
        if not isinstance(other, (ndarray, numbers.Number, np.generic, bool)):
            return NotImplemented
        return _apply((lambda a, b: op(b, a)) if reflected else op, self, other)

    return method


for _name, _op in [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("pow", operator.pow),
    ("matmul", operator.matmul),
    ("and", operator.and_),
    ("or", operator.or_),
    ("xor", operator.xor),
    ("lshift", operator.lshift),
    ("rshift", operator.rshift),
]:
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(
        ndarray,
        f"__i{_name}__",
        (lambda iop: lambda self, other: self._inplace(iop, other))(getattr(operator, f"i{_name}")),
    )
for _name, _op in [
    ("eq", operator.eq),
    ("ne", operator.ne),
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
]:
    setattr(ndarray, f"__{_name}__", _binary(_op))
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs), ("invert", operator.invert)]:
    setattr(ndarray, f"__{_name}__", (lambda f: lambda self: _apply(f, self))(_op))
ndarray.__divmod__ = _binary(divmod)  # type: ignore[attr-defined]

_METHODS = [
    "all",
    "any",
    "sum",
    "mean",
    "prod",
    "max",
    "min",
    "argmax",
    "argmin",
    "cumsum",
    "ravel",
    "flatten",
    "transpose",
    "swapaxes",
    "squeeze",
    "clip",
    "round",
    "dot",
    "nonzero",
    "take",
    "repeat",
    "conj",
    "std",
    "var",
    "sort",
    "argsort",
]
for _name in _METHODS:
    setattr(ndarray, _name, (lambda n: lambda self, *a, **k: _apply(getattr(np.ndarray, n), self, *a, **k))(_name))


# -- module functions ---------------------------------------------------------------------------------
def get_array_module(*args: Any) -> Any:
    return sys.modules[__name__] if _builtins.any(isinstance(a, ndarray) for a in args) else np


def _from_host(obj: Any, dtype: Any, copy: bool, order: Any, ndmin: int = 0) -> ndarray:
    if isinstance(obj, ndarray):
        obj._check_device()
        if not copy and (dtype is None or np.dtype(dtype) == obj.dtype) and ndmin <= obj.ndim:
            return obj
        return _apply(lambda a: np.array(a, dtype=dtype, order=order or "K", ndmin=ndmin, copy=True), obj)
    if not isinstance(obj, (np.ndarray, list, tuple) + _SCALARS):
        imported = _consume(obj)
        if imported is not None:
            return _from_host(imported, dtype, copy, order, ndmin)
    if isinstance(obj, (list, tuple)) and _builtins.any(isinstance(x, ndarray) for x in obj):
        return _apply(lambda *xs: np.array(list(xs), dtype=dtype, order=order or "K", ndmin=ndmin), *obj)
    host = np.array(obj, dtype=dtype, order=order or "K", ndmin=ndmin, copy=True)
    if host.dtype == object:
        raise ValueError("Unsupported dtype object")
    LEDGER.copy("h2d", host.nbytes)
    fresh = _new(host)
    fresh._wrote()
    return fresh


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    """A device array of ``a`` (a copy to the device for host data, counted)."""
    return _from_host(a, dtype, copy=False, order=order)


def array(
    obj: Any,
    dtype: Any = None,
    copy: bool = True,
    order: str = "K",
    subok: bool = False,
    ndmin: int = 0,
    *,
    blocking: bool = False,
) -> ndarray:
    return _from_host(obj, dtype, copy=copy, order=order, ndmin=ndmin)


_DLPACK_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged: the memory CuPy imports


def from_dlpack(obj: Any, *, device: Any = None, copy: Any = None) -> ndarray:
    """A device array viewing the memory of a DLPack exporter on the device, as CuPy imports it.

    The exporter's ``__dlpack_device__`` must be a CUDA device (host memory raises ``ValueError``,
    as in CuPy 13); the consumer's current stream goes to its ``__dlpack__`` as ``stream=`` (1 for
    the null stream). The result shares the exporter's memory, and the work still writing it stays
    tracked; imports are counted (``dlpack_imports``), copies are not made.
    """
    if isinstance(obj, ndarray):
        LEDGER.add("dlpack_imports")
        return _new(obj._a.view(), obj._root(), obj._device)
    kind, _ = obj.__dlpack_device__()
    if kind not in _DLPACK_DEVICES:
        raise ValueError(f"Unsupported DLPack device type {kind}: CuPy imports CUDA and CUDA managed memory only")
    stream = get_current_stream()
    imported = _consume(obj, "__dlpack__", stream=1 if stream.is_null else stream.ptr)
    if imported is None:
        raise TypeError(_UNSUPPORTED.format(type(obj)))
    LEDGER.add("dlpack_imports")
    return imported


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None, *, blocking: bool = True) -> np.ndarray:
    """A host copy of a device array (NumPy input is returned as an array)."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    result = np.asarray(a, order=order)
    if out is not None:
        out[...] = result
        return out
    return result


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _new(np.empty(shape, dtype=dtype, order=order))


def _filled(make: Callable[..., np.ndarray]) -> Callable[..., ndarray]:
    def create(*args: Any, **kwargs: Any) -> ndarray:
        fresh = _new(make(*args, **kwargs))
        fresh._wrote()
        return fresh

    create.__name__ = make.__name__
    return create


zeros, ones, full, arange, linspace, eye, identity = (
    _filled(f) for f in (np.zeros, np.ones, np.full, np.arange, np.linspace, np.eye, np.identity)
)


def _like(make: Callable[..., np.ndarray], fill: bool) -> Callable[..., ndarray]:
    def create(a: Any, *args: Any, **kwargs: Any) -> ndarray:
        if isinstance(a, np.ndarray):
            raise TypeError(_UNSUPPORTED.format(type(a)))
        fresh = _new(make(a._a if isinstance(a, ndarray) else a, *args, **kwargs))
        if fill:
            fresh._wrote()
        return fresh

    create.__name__ = make.__name__
    return create


empty_like = _like(np.empty_like, False)
zeros_like, ones_like, full_like = (_like(f, True) for f in (np.zeros_like, np.ones_like, np.full_like))


def copyto(dst: ndarray, src: Any, casting: str = "same_kind", where: Any = True) -> None:
    if not isinstance(dst, ndarray):
        raise TypeError(_UNSUPPORTED.format(type(dst)))
    dst._check_device()
    np.copyto(dst._a, _unwrap(src), casting=casting, where=_unwrap(where))
    dst._wrote()


_FUNCTIONS = [
    "add",
    "subtract",
    "multiply",
    "divide",
    "true_divide",
    "floor_divide",
    "mod",
    "remainder",
    "power",
    "negative",
    "abs",
    "absolute",
    "sqrt",
    "square",
    "exp",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "sin",
    "cos",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "isfinite",
    "flatnonzero",
    "isnan",
    "isinf",
    "where",
    "clip",
    "sum",
    "mean",
    "prod",
    "max",
    "min",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "all",
    "any",
    "dot",
    "matmul",
    "concatenate",
    "stack",
    "vstack",
    "hstack",
    "moveaxis",
    "swapaxes",
    "broadcast_to",
    "reshape",
    "ravel",
    "transpose",
    "divmod",
    "equal",
    "not_equal",
    "less",
    "greater",
    "less_equal",
    "greater_equal",
    "logical_and",
    "logical_or",
    "logical_not",
    "sign",
    "floor",
    "ceil",
    "round",
    "around",
    "cumsum",
    "sort",
    "argsort",
    "unique",
    "take",
    "einsum",
    "outer",
    "frexp",
    "ldexp",
    "nonzero",
    "count_nonzero",
    "array_equal",
    "allclose",
    "isclose",
    "expand_dims",
    "squeeze",
    "atleast_1d",
    "atleast_2d",
    "bincount",
    "tile",
    "repeat",
    "flip",
    "roll",
    "var",
    "std",
    "log2",
]
for _name in _FUNCTIONS:
    _np = getattr(np, _name)
    globals()[_name] = (lambda f: lambda *a, **k: _apply(f, *a, **k))(_np)

dtype = np.dtype
newaxis = np.newaxis
inf, nan, pi, e = np.inf, np.nan, np.pi, np.e
bool_ = np.bool_
(int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, float32, float64, complex64, complex128) = (
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
)
intp, int_, float_ = np.intp, np.int64, np.float64
finfo, iinfo, result_type, can_cast, issubdtype = np.finfo, np.iinfo, np.result_type, np.can_cast, np.issubdtype
floating, integer, complexfloating, number, generic = np.floating, np.integer, np.complexfloating, np.number, np.generic
