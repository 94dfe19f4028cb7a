"""Stand-in ``cupyx``: pinned host arrays (see tests/helpers/standin/README.md)."""

from __future__ import annotations

from typing import Any

import cupy  # noqa: F401  (refuses to load next to the real CuPy)
import numpy as np
from cupy.cuda import alloc_pinned_memory


def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    """A NumPy array in (stand-in) page-locked memory."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = alloc_pinned_memory(count * dtype.itemsize)
    return np.frombuffer(memory, dtype, count).reshape(shape, order=order)


def zeros_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    out = empty_pinned(shape, dtype, order)
    out[...] = 0
    return out
