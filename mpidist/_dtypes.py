"""Which dtypes of other packages mpidist knows by name. Pure, no MPI."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["is_bfloat16"]


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Local: whether ``dtype`` (a user-defined NumPy dtype) is ml_dtypes' bfloat16.

    Never imports ml_dtypes: a bfloat16 array exists only where it was imported.
    """
    ml_dtypes = sys.modules.get("ml_dtypes")
    return ml_dtypes is not None and dtype.type is ml_dtypes.bfloat16
