"""What the stand-in saw: host/device copies, synchronisations, MPI reads of device buffers, violations."""

from __future__ import annotations

import threading
from typing import Any


class Ledger:
    """Counters the tests read and reset (``cupy._ledger.LEDGER``)."""

    COUNTERS = (
        "h2d",
        "d2h",
        "h2d_bytes",
        "d2h_bytes",
        "scalar_reads",
        "syncs",
        "mpi_reads",
        "pinned_allocs",
        "dlpack_imports",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter and forget the violations."""
        with self._lock:
            for name in self.COUNTERS:
                setattr(self, name, 0)
            self.violations: list[str] = []
            self.implicit: list[str] = []

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def copy(self, direction: str, nbytes: int) -> None:
        """One explicit copy, ``"h2d"`` or ``"d2h"``, of ``nbytes`` bytes."""
        with self._lock:
            setattr(self, direction, getattr(self, direction) + 1)
            setattr(self, direction + "_bytes", getattr(self, direction + "_bytes") + int(nbytes))

    def violation(self, text: str) -> None:
        with self._lock:
            self.violations.append(text)

    def implicit_conversion(self, text: str) -> None:
        with self._lock:
            self.implicit.append(text)

    def snapshot(self) -> dict[str, Any]:
        """The counters now, as a dict (violations and implicit conversions as counts)."""
        with self._lock:
            out = {name: getattr(self, name) for name in self.COUNTERS}
            out["violations"] = len(self.violations)
            out["implicit"] = len(self.implicit)
            return out

    def copies(self) -> tuple[int, int]:
        """``(host-to-device, device-to-host)`` copies so far."""
        return self.h2d, self.d2h


LEDGER = Ledger()
