"""The reduction algorithms behind their template, under mpiexec (1, 2 and 3 ranks).

Each algorithm reduces MPI-ready buffers in place (the callers copy a separate
input into the output first), blocking and in nonblocking pieces, over a
duplicate of COMM_SELF and of COMM_WORLD; expected values are derived from rank
and size. At one rank the template makes no MPI call at all.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._comm.algorithms import Algorithms, Flat, Hierarchical, Reduction
from mpidist._comm.topology import Topology
from mpidist._comm.transport import Transport
from mpidist._options import Options

pytestmark = pytest.mark.mpi

SETTINGS = {"flat": {}, "two-level": {"hierarchical": True, "node_size": 2}}


@pytest.fixture(
    scope="module",
    params=[(base, algo) for base in ("self", "world") for algo in SETTINGS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def reduction(request):
    base, algo = request.param
    comm = (MPI.COMM_SELF if base == "self" else MPI.COMM_WORLD).Dup()
    options = Options(piece_bytes=1024, timeout=None if base == "self" else 60.0, **SETTINGS[algo])
    topology = Topology(comm)
    algorithms = Algorithms(Transport(comm, options), topology)
    yield algorithms.choose(0)
    algorithms.free()
    topology.free()
    comm.Free()


def contribution(rank: int, n: int) -> np.ndarray:
    return (rank + 1) * np.arange(n, dtype=np.float64)


def total(size: int, n: int) -> np.ndarray:
    return size * (size + 1) / 2 * np.arange(n, dtype=np.float64)


def test_the_rule_follows_the_options(reduction):
    want = Hierarchical if reduction.transport.options.hierarchical else Flat
    assert type(reduction) is want and isinstance(reduction, Reduction)


@pytest.mark.parametrize("n", [0, 1, 300, 1000])
def test_pieces_cover_the_array_in_piece_bytes(reduction, n):
    ranges = reduction.pieces(np.empty(n))
    assert [lo for lo, _ in ranges] == list(range(0, n, 128))  # 1024 bytes of float64
    assert all(hi - lo <= 128 for lo, hi in ranges) and (not ranges or ranges[-1][1] == n)


@pytest.mark.parametrize("n", [1, 300])
def test_blocking_in_place(reduction, n):
    t = reduction.transport
    for _ in range(2):
        buf = contribution(t.rank, n)
        reduction.reduce("test", buf, MPI.SUM)
        np.testing.assert_array_equal(buf, total(t.size, n))


def test_nonblocking_pieces(reduction):
    t = reduction.transport
    for _ in range(2):
        buf = contribution(t.rank, 300)
        requests, complete = reduction.start("test", [buf[lo:hi] for lo, hi in reduction.pieces(buf)], MPI.SUM)
        t.wait(requests, "test")
        complete()
        np.testing.assert_array_equal(buf, total(t.size, 300))


def test_one_replica_makes_no_mpi_call():
    """The template's one-replica case: the buffer is the result, also on a communicator MPI could no longer use."""
    comm = MPI.COMM_SELF.Dup()
    transport = Transport(comm, Options())
    reduction = Flat(transport)
    transport.free()
    assert transport.comm == MPI.COMM_NULL
    buf = np.arange(4.0)
    reduction.reduce("alone", buf, MPI.SUM)
    requests, complete = reduction.start("alone", [buf[:2], buf[2:]], MPI.SUM)
    complete()
    assert requests == [] and buf.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("options", [{}, {"node_size": 2}], ids=["auto", "auto-node_size"])
def test_auto_on_one_node_is_the_flat_reduction_and_builds_no_two_level_one(options):
    """The default (``hierarchical=None``) on one node: today's flat reduction, at every size, nothing split."""
    comm = MPI.COMM_WORLD.Dup()
    topology = Topology(comm)
    if topology.num_nodes > 1:
        pytest.skip("the job spans nodes")
    algorithms = Algorithms(Transport(comm, Options(timeout=60.0, **options)), topology)
    try:
        assert algorithms.hierarchical is None
        assert all(algorithms.choose(n) is algorithms.flat for n in (0, 8, 1 << 20, 1 << 30))
    finally:
        algorithms.free()
        topology.free()
        comm.Free()
