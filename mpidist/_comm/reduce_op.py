"""Reduction operations shared by the communicator and the strategy."""
from __future__ import annotations

import enum
from typing import Union

__all__ = ["ReduceOp"]


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
    def of(cls, op: Union["ReduceOp", str]) -> "ReduceOp":
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
