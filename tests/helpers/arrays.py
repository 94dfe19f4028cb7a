"""Assertions that accept NumPy and CuPy arrays alike, so one test runs on CPU and GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpidist._comm.backend import to_host

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
"""Parameters for a strategy fixture: NumPy components, and CuPy components where a GPU exists."""


def host(value: Any) -> Any:
    """``value`` with device arrays copied to the host (other values unchanged)."""
    return to_host(value) if hasattr(value, "shape") else value


def assert_equal(actual: Any, expected: Any) -> None:
    np.testing.assert_array_equal(host(actual), host(expected))


def assert_close(actual: Any, expected: Any, **tolerances: Any) -> None:
    np.testing.assert_allclose(host(actual), host(expected), **tolerances)
