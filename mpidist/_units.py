"""Human-readable quantities for messages, listings and reports. Pure, no MPI."""
from __future__ import annotations

__all__ = ["human_size"]

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_size(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``, ``64 << 20`` -> ``"64 MiB"``, ``100`` -> ``"100 B"``.

    Local. Binary units, at most one decimal, trailing zeros dropped.
    """
    for unit, scale in _UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{nbytes} B"
