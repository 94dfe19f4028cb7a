"""Reduction operations shared by the communicator and the strategy."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["ReduceOp", "divide_in_place"]


class ReduceOp(enum.Enum):
    """How values from all replicas combine.

    ``SUM`` and ``MEAN`` are the cross-replica reductions of the strategy API;
    ``MIN``, ``MAX`` and ``PROD`` are also accepted by the communicator.
    """

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    __hash__ = object.__hash__  # members are singletons: identity hashing, at C speed (ops key caches)

    @classmethod
    def of(cls, op: Union[ReduceOp, str]) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name (``"sum"``, ``"MEAN"``, ...)."""
        if op.__class__ is cls:
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        names = ", ".join(m.name for m in cls)
        raise ValueError(f"unknown reduce op {op!r}; expected a ReduceOp ({names}) or its name")


def divide_in_place(array: Array, ranks: int) -> None:
    """Local: ``array /= ranks`` (the last step of ``MEAN``), as a multiplication when that is exact.

    For a power of two, ``x * (1 / ranks)`` is the same number as ``x / ranks``
    (both exact up to rounding of the same real), and a multiplication
    costs about half a division on large arrays; other counts divide.
    """
    if ranks & (ranks - 1) == 0:
        array *= 1.0 / ranks
    else:
        array /= ranks
