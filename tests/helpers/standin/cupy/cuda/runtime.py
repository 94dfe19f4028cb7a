"""Stand-in ``cupy.cuda.runtime``: device count and properties."""

from __future__ import annotations

import os
from typing import Any


class CUDARuntimeError(RuntimeError):
    """What CuPy raises for CUDA runtime errors."""


def getDeviceCount() -> int:
    """``len(CUDA_VISIBLE_DEVICES)`` when set, else ``MPIDIST_STANDIN_GPUS`` (default 2)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    return int(os.environ.get("MPIDIST_STANDIN_GPUS", "2"))


def _check(device: int) -> None:
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {device}")


def getDevice() -> int:
    from cupy.cuda import current_device_id

    return current_device_id()


def setDevice(device: int) -> None:
    from cupy.cuda import Device

    Device(device).use()


def getDeviceProperties(device: int) -> dict[str, Any]:
    _check(device)
    return {
        "name": b"CuPy stand-in (host memory)",
        "totalGlobalMem": 80 << 30,
        "major": 9,
        "minor": 0,
        "multiProcessorCount": 132,
        "pciBusID": device + 1,
        "pciDeviceID": 0,
        "pciDomainID": 0,
    }


def deviceGetPCIBusId(device: int) -> str:
    _check(device)
    return f"0000:{device + 1:02X}:00.0"


def runtimeGetVersion() -> int:
    return 12080


def driverGetVersion() -> int:
    return 12080
