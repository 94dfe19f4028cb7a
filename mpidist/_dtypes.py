"""Which dtypes of other packages mpidist knows by name. Pure, no MPI."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["bfloat16", "is_bfloat16"]


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Local: whether ``dtype`` (a user-defined NumPy dtype) is ml_dtypes' bfloat16.

    Never imports ml_dtypes: a bfloat16 array exists only where it was imported.
    """
    ml_dtypes = sys.modules.get("ml_dtypes")
    return ml_dtypes is not None and dtype.type is ml_dtypes.bfloat16


def bfloat16() -> np.dtype[Any]:
    """Local: ml_dtypes' bfloat16 dtype (importing ml_dtypes); ``ImportError`` saying how to install it."""
    try:
        import ml_dtypes
    except ImportError as exc:
        raise ImportError("bfloat16 needs ml_dtypes, which is not installed: pip install 'mpidist[bfloat16]'") from exc
    return np.dtype(ml_dtypes.bfloat16)
