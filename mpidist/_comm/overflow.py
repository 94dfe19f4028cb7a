"""Integer sums that refuse to wrap around (``check_overflow``). Everything here is local.

MPI adds integers in their own dtype, so a sum that does not fit wraps
around silently. With the check on, the communicator reduces a 64-bit form
of the values instead, whose sum cannot wrap for fewer than 2**31 ranks:

- integers of up to 32 bits: the values as ``int64``;
- 64-bit integers: their high and low 32-bit halves, side by side, as ``int64``.

Every rank then holds the same exact sums, so every rank reaches the same
verdict without another message: either the sums fit the dtype and are
written, or :class:`~mpidist.IntegerOverflowError` is raised before anything
is written.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from mpidist._comm.backend import array_module
from mpidist._comm.reduce_op import ReduceOp
from mpidist._errors import IntegerOverflowError, on_rank

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["applies", "narrow", "widen"]

_LOW = 0xFFFFFFFF
_SHOWN = 10


def applies(op: Optional[ReduceOp], dtype: np.dtype[Any]) -> bool:
    """Whether a reduction by ``op`` of ``dtype`` is checked: SUM of signed or unsigned integers."""
    return op is ReduceOp.SUM and dtype.kind in "iu"


def widen(array: Array) -> Array:
    """A flat ``int64`` array whose elementwise SUM over ranks is exact (see the module docstring)."""
    xp = array_module(array)
    flat = array.reshape(-1)
    if array.dtype.itemsize < 8:
        return flat.astype(np.int64)
    wide = xp.empty(2 * flat.size, dtype=np.int64)
    high, low = wide[: flat.size], wide[flat.size :]
    if array.dtype.kind == "i":
        xp.right_shift(flat, 32, out=high)  # arithmetic: the signed high half
    else:
        high[...] = flat >> np.uint64(32)
    low[...] = flat & array.dtype.type(_LOW)
    return wide


def narrow(wide: Array, dtype: np.dtype[Any], name: str, rank: int) -> Array:
    """The exact sums held by ``wide`` (a reduced :func:`widen`) as a flat array of ``dtype``.

    Raises :class:`~mpidist.IntegerOverflowError` when a sum does not fit.
    ``wide`` may also be float64 sums of integers of up to 32 bits (exact).
    """
    xp = array_module(wide)
    info = np.iinfo(dtype)
    if dtype.itemsize < 8:
        bad = (wide < info.min) | (wide > info.max)
        if bool(bad.any()):
            _refuse(xp, bad, lambda i: int(wide[i]), dtype, name, rank)
        return wide.astype(dtype)
    n = wide.size // 2
    high = wide[:n] + (wide[n:] >> 32)  # carry the low halves' overflow into the high half
    low = wide[n:] & _LOW
    lo, hi = (-(1 << 31), (1 << 31) - 1) if dtype.kind == "i" else (0, (1 << 32) - 1)
    bad = (high < lo) | (high > hi)
    if bool(bad.any()):
        _refuse(xp, bad, lambda i: (int(high[i]) << 32) + int(low[i]), dtype, name, rank)
    return ((high.astype(np.uint64) << np.uint64(32)) | low.astype(np.uint64)).view(dtype)


def _refuse(
    xp: ModuleType, bad: Array, exact: Callable[[int], int], dtype: np.dtype[Any], name: str, rank: int
) -> None:
    indices = [int(i) for i in xp.flatnonzero(bad)[:_SHOWN].tolist()]
    count = int(bad.sum())
    info = np.iinfo(dtype)
    shown = ", ".join(f"[{i}] = {exact(i)}" for i in indices[:3])
    raise IntegerOverflowError(
        on_rank(
            rank,
            f"the SUM of {name!r} does not fit dtype {dtype} ({info.min} to {info.max}) at {count} "
            f"element{'s' if count > 1 else ''} ({shown}{', ...' if count > 3 else ''}); nothing was "
            "written. Reduce a wider dtype (for example int64), or turn check_overflow off to wrap "
            "around as MPI does.",
        ),
        name,
        indices,
    )
