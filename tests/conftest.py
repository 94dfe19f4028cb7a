"""Shared pytest configuration for the mpidist tests.

- ``comm`` fixture: ``MPI.COMM_WORLD`` (mpi4py is imported on first use, not here).
- ``@pytest.mark.gpu``: skipped unless CuPy imports and sees a CUDA device. With
  ``MPIDIST_TEST_DEVICE=standin`` the CPU stand-in for CuPy in ``tests/helpers/standin/`` is imported as
  ``cupy`` instead (it refuses to load next to the real CuPy); every gpu test then also checks
  that no device buffer reached MPI unsynchronised and nothing was converted to the host implicitly
  (the ``device_ledger`` fixture gives the stand-in's copy counters).
- Header line: MPI library, rank and size, so each rank's report says where it comes from.
- ``--junitxml`` under ``--with-mpi``: one report per rank (``NAME.rank<R>.xml``), not one file
  that every rank writes.
- Hypothesis: no example database, its other files in a per-user directory under the
  system's temporary directory (no ``.hypothesis/`` left behind), no deadline (ranks share
  cores), and under ``--with-mpi`` derandomized, so every rank draws the same examples and
  reaches the same collectives.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

TEST_DEVICE = os.environ.get("MPIDIST_TEST_DEVICE", "")
if TEST_DEVICE not in ("", "cupy", "standin"):
    raise pytest.UsageError(
        f"MPIDIST_TEST_DEVICE={TEST_DEVICE!r}: expected 'standin' (the CPU stand-in "
        "for CuPy in tests/helpers/standin/) or 'cupy' (the installed CuPy, the default)"
    )
if TEST_DEVICE == "standin":  # before any test module imports cupy
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "standin"))


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


@pytest.hookimpl(tryfirst=True)  # before the junitxml plugin opens its file
def pytest_configure(config):
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and config.getoption("--with-mpi", default=False):
        from mpi4py import MPI

        root, ext = os.path.splitext(xmlpath)
        config.option.xmlpath = f"{root}.rank{MPI.COMM_WORLD.Get_rank()}{ext}"
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
        if TEST_DEVICE == "standin":  # asked for: never skip silently
            raise pytest.UsageError(f"MPIDIST_TEST_DEVICE=standin: {exc}") from exc
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


def _standin_ledger():
    """The CuPy stand-in's ledger, or None with the real CuPy."""
    if TEST_DEVICE != "standin":
        return None
    from cupy._ledger import LEDGER

    return LEDGER


@pytest.fixture(autouse=True)
def _device_buffers_checked(request):
    """gpu tests on the stand-in: no device buffer reached MPI before its stream was synchronised.

    (An implicit host conversion raises ``TypeError``, as with CuPy, so it fails the test by itself.)
    """
    ledger = _standin_ledger() if request.node.get_closest_marker("gpu") is not None else None
    if ledger is None:
        yield
        return
    ledger.reset()
    yield
    assert ledger.violations == [], "device buffers read before their stream was synchronised"


@pytest.fixture
def device_ledger():
    """The stand-in's counters of host/device copies (reset now); skips with the real CuPy."""
    ledger = _standin_ledger()
    if ledger is None:
        pytest.skip("counts host/device copies: needs the CuPy stand-in (MPIDIST_TEST_DEVICE=standin)")
    ledger.reset()
    return ledger


@pytest.fixture(scope="session")
def comm():
    """``MPI.COMM_WORLD``: size 1 in a serial run, all ranks under ``mpiexec``."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
