"""Human-readable quantities for messages, listings and reports. Pure, no MPI."""

from __future__ import annotations

__all__ = ["human_size", "human_time"]

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_size(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``, ``64 << 20`` -> ``"64 MiB"``, ``100`` -> ``"100 B"``.

    Local. Binary units, at most one decimal, trailing zeros dropped.
    """
    for unit, scale in _UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{nbytes} B"


def human_time(seconds: float) -> str:
    """``2.5e-5`` -> ``"25.0 us"``, ``0.0123`` -> ``"12.30 ms"``, ``3.0`` -> ``"3.00 s"``. Local."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
