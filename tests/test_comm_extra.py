"""Byte-payload collectives of the Communicator (allgather_bytes, broadcast_bytes), under mpiexec.

Expected values derive from rank and size; each check runs twice, over duplicates of
COMM_SELF and COMM_WORLD, with and without agreement checks.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._comm.communicator import Communicator
from mpidist._options import Options

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=["self", "world", "world-unchecked"])
def comm(request):
    base = MPI.COMM_SELF if request.param == "self" else MPI.COMM_WORLD
    options = Options.resolve(env={}, check_collectives=request.param != "world-unchecked")
    c = Communicator(base, options)
    yield c
    c.free()


def payload(rank: int) -> bytes:
    """Rank r's payload: r bytes (rank 0 sends nothing), with values that depend on r."""
    return bytes((rank * 7 + i) % 256 for i in range(rank))


@pytest.mark.parametrize("repeat", [1, 2])
def test_allgather_bytes_returns_every_ranks_payload_in_rank_order(comm, repeat):
    got = comm.allgather_bytes(payload(comm.rank), name="test")
    assert got == [payload(r) for r in range(comm.size)]


def test_allgather_bytes_of_a_large_payload(comm):
    data = np.full(1 << 20, comm.rank, np.uint8).tobytes()
    got = comm.allgather_bytes(data)
    assert [len(g) for g in got] == [1 << 20] * comm.size
    assert all(set(g) == {r} for r, g in enumerate(got))


@pytest.mark.parametrize("repeat", [1, 2])
def test_broadcast_bytes_from_every_root(comm, repeat):
    for root in range(comm.size):
        message = f"from root {root} of {comm.size}".encode() * (root + 1)
        got = comm.broadcast_bytes(message if comm.rank == root else None, root, name="test")
        assert got == message


def test_broadcast_bytes_of_nothing(comm):
    assert comm.broadcast_bytes(b"" if comm.rank == 0 else b"ignored") == b""
    assert comm.broadcast_bytes(None) == b""
