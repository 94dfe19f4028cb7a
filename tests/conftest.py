"""Shared pytest configuration for the mpidist tests.

- ``comm`` fixture: ``MPI.COMM_WORLD`` (mpi4py is imported on first use, not here).
- ``@pytest.mark.gpu``: skipped unless CuPy imports and sees a CUDA device.
- Header line: MPI library, rank and size, so each rank's report says where it comes from.
- Hypothesis: no example database, its other files in a per-user directory under the
  system's temporary directory (no ``.hypothesis/`` left behind), no deadline (ranks share cores), and under ``--with-mpi``
  derandomized, so every rank draws the same examples and reaches the same collectives.
"""
from __future__ import annotations

import os
import tempfile

import pytest


def _mpi_description() -> str:
    from mpi4py import MPI

    from mpidist._comm.library import library_version

    major, minor = MPI.Get_version()
    comm = MPI.COMM_WORLD
    return f"{library_version()} (MPI {major}.{minor}), rank {comm.Get_rank()} of {comm.Get_size()}"


def pytest_report_header(config):
    try:
        description = _mpi_description()
    except (ImportError, RuntimeError) as exc:  # no mpi4py, or MPI failed to initialise
        description = f"unavailable ({type(exc).__name__}: {exc})"
    mode = "with --with-mpi" if config.getoption("--with-mpi", default=False) else "serial"
    return f"mpi: {description}; {mode}"


def pytest_configure(config):
    try:
        from hypothesis import HealthCheck, settings
        from hypothesis.configuration import set_hypothesis_home_dir
    except ImportError:
        return
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        # Hypothesis caches files (constants of local modules) even without a database: keep
        # them out of the working tree, in one directory per user that every run reuses (a
        # rank ended by MPI_Abort cannot clean up after itself; the writes are atomic).
        user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
        set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), f"mpidist-hypothesis-{user}"))
    settings.register_profile(
        "mpidist",
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=bool(config.getoption("--with-mpi", default=False)),
    )
    settings.load_profile("mpidist")


def _gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when CuPy sees a CUDA device."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError, missing driver libraries, ...: report it
        return f"CuPy finds no usable CUDA runtime ({type(exc).__name__}: {exc})"
    if count < 1:
        return "CuPy sees no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # do not import CuPy at all
    reason = _gpu_unavailable_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"gpu test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def comm():
    """``MPI.COMM_WORLD``: size 1 in a serial run, all ranks under ``mpiexec``."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
