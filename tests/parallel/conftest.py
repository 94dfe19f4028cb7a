"""Fixtures of the MPI suites (under mpiexec, every rank runs them alike)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """Collective: a fresh directory every rank sees (made by rank 0, its path broadcast), removed afterwards.

    It is made in ``MPIDIST_TEST_SHARED_DIR`` when set (a shared file system, for runs over
    several nodes), else in the temporary directory.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    base = os.environ.get("MPIDIST_TEST_SHARED_DIR") or None
    path = world.bcast(tempfile.mkdtemp(prefix="mpidist-test-", dir=base) if world.rank == 0 else None)
    yield Path(path)
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
