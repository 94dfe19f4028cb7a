"""Flat variable storage: arrays that are consecutive views of a few large buffers (slabs).

A fused reduction of arrays that lie back to back in one buffer needs no
packing: the buffer's span is reduced where it is, in pieces. This module hands
out such arrays (:class:`FlatStore`, from slabs of ``slab_bytes``), tells
whether two arrays lie back to back (:func:`joinable`), gives the flat view of
a span of such arrays (:func:`span`), and makes zero-filled arrays laid out
like given ones (:func:`zeros_like_layout`), for example gradients of flat
variables. Everything here is local: nothing communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from mpidist._comm.backend import data_pointer

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from mpidist._typing import Array

__all__ = ["FlatStore", "joinable", "span", "zeros_like_layout"]

_SLAB_BYTES = 64 << 20


def _owner(array: Array) -> Optional[tuple[Array, int]]:
    """``(flat view of the buffer array is a view of, offset of array in it)``, or ``None``."""
    base = array.base
    if (
        base is None
        or not hasattr(base, "dtype")
        or base.dtype != array.dtype
        or not base.flags.c_contiguous
        or not array.flags.c_contiguous
    ):
        return None
    offset, rest = divmod(data_pointer(array) - data_pointer(base), array.itemsize)
    if rest or offset < 0 or offset + array.size > base.size:
        return None
    return base.reshape(-1), offset


def joinable(a: Array, b: Array) -> bool:
    """Whether ``b`` starts right where ``a`` ends, in the same buffer and with the same dtype."""
    if a.dtype != b.dtype or a.base is None or a.base is not b.base or not b.flags.c_contiguous:
        return False
    return a.flags.c_contiguous and data_pointer(a) + a.nbytes == data_pointer(b)


def span(arrays: Sequence[Array]) -> Array:
    """A flat view of the memory of ``arrays``: one array, or a span of :func:`joinable` ones."""
    if len(arrays) == 1:
        return arrays[0].reshape(-1)
    flat, offset = _owner(arrays[0])  # type: ignore[misc]  # joinable arrays have an owner
    return flat[offset : offset + sum(a.size for a in arrays)]


class FlatStore:
    """Hands out zero-filled arrays as consecutive views of slabs, one series of slabs per dtype.

    Arrays allocated one after another with the same dtype lie back to back
    (:func:`joinable`) until a slab of ``slab_bytes`` is full; an array larger
    than that gets a buffer of its own. A slab is freed when no view of it is
    left. Local.
    """

    def __init__(self, xp: ModuleType, slab_bytes: int = _SLAB_BYTES) -> None:
        self._xp = xp
        self._slab_bytes = slab_bytes
        self._open: dict[str, tuple[Any, int]] = {}  # dtype -> (slab, elements handed out)

    def zeros(self, shape: Sequence[int], dtype: DTypeLike) -> Array:
        """A zero-filled C-contiguous array of ``shape`` and ``dtype``, a view of a shared slab."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        slab = max(1, self._slab_bytes // dtype.itemsize)
        if n >= slab:
            return self._xp.zeros(n, dtype=dtype).reshape(shape)
        buffer, used = self._open.get(dtype.str, (None, 0))
        if buffer is None or used + n > buffer.size:
            buffer, used = self._xp.zeros(slab, dtype=dtype), 0
        self._open[dtype.str] = (buffer, used + n)
        return buffer[used : used + n].reshape(shape)


def zeros_like_layout(arrays: Sequence[Array], xp: ModuleType) -> list[Array]:
    """Zero-filled arrays shaped like ``arrays``, where spans of joinable arrays get joinable results.

    One buffer per span, so a fused reduction of the results needs no packing
    when ``arrays`` need none. Local.
    """
    result: list[Array] = []
    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and joinable(arrays[end - 1], arrays[end]):
            end += 1
        members = arrays[start:end]
        buffer = xp.zeros(sum(a.size for a in members), dtype=members[0].dtype)
        offset = 0
        for a in members:
            result.append(buffer[offset : offset + a.size].reshape(a.shape))
            offset += a.size
        start = end
    return result
