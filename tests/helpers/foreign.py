"""Arrays of other libraries as mpidist meets them: stand-ins for the odd shapes of the array protocols.

Each wraps a NumPy or CuPy array (``.backing``) and shares its memory, so a test can see what a
collective wrote into the caller's object:

- :class:`ArrayOnly`: only ``__array__`` (host memory), like many small array libraries;
- :class:`DLPackOnly`: only ``__dlpack__`` / ``__dlpack_device__``: no ``dtype``, ``shape`` or
  ``__array__`` (``numpy.asarray`` of it is an object array);
- :class:`TorchLike`: a torch tensor's surface: its own ``dtype`` (not a NumPy dtype) and
  ``shape``, ``__array__`` (which refuses device memory, as torch's does for CUDA tensors),
  ``__dlpack__``, ``__cuda_array_interface__`` for device memory, and ``.data`` another tensor of
  the same memory (not a pointer object), but no ``flags``;
- :class:`RequiresGrad`: a :class:`TorchLike` whose library refuses both ways out (as torch does
  for a tensor that requires grad).

Over a CuPy array (or the CuPy stand-in's), :class:`DLPackOnly` and :class:`TorchLike` are device
arrays of another library, as a torch CUDA tensor is: ``cupy.from_dlpack`` imports them.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ArrayOnly:
    """An array with only ``__array__`` (a view of its NumPy backing)."""

    def __init__(self, backing: np.ndarray) -> None:
        self.backing = backing

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.backing, dtype=dtype)


class DLPackOnly:
    """An array with only ``__dlpack__`` and ``__dlpack_device__`` (forwarded to its backing)."""

    def __init__(self, backing: Any) -> None:
        self.backing = backing

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.backing.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.backing.__dlpack_device__()


class TorchDtype:
    """A dtype object of another library: equal only to itself, not a NumPy dtype."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torchlike.{self.name}"


class TorchLike(DLPackOnly):
    """A torch-like tensor: own ``dtype`` and ``shape``, ``__array__``, DLPack, ``.data`` a tensor."""

    @property
    def dtype(self) -> TorchDtype:
        return TorchDtype(self.backing.dtype.name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.backing.shape)

    @property
    def data(self) -> TorchLike:
        """As torch's ``Tensor.data``: the same memory as another tensor (no ``.ptr``)."""
        return TorchLike(self.backing)

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.backing.__dlpack_device__()[0] == 1:
            raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")
        return self.backing.__cuda_array_interface__

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.backing.__dlpack_device__()[0] != 1:
            raise TypeError("can't convert cuda device type tensor to numpy; use Tensor.cpu() first")
        return np.asarray(self.backing, dtype=dtype)


HOST_KINDS = [ArrayOnly, DLPackOnly, TorchLike]
"""The stand-ins that work over host (NumPy) memory."""

DEVICE_KINDS = [DLPackOnly, TorchLike]
"""The stand-ins that work over device (CuPy) memory."""


class RequiresGrad(TorchLike):
    """A tensor its library will not hand out (as torch refuses a tensor that requires grad)."""

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
