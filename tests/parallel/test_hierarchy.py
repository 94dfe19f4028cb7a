"""The hierarchical (two-level) allreduce gives what the flat one gives (1, 2 and 3 ranks).

A forced ``node_size`` groups consecutive ranks into "nodes" on one machine:
1 (every rank its own node: the leaders do all the work), 2 (at 3 ranks a node
of two and a node of one) and 0 (the real shared-memory node: all ranks). Each
case runs blocking, pipelined (pieces of 1 KiB), nonblocking, fused, and with
a timeout (the polled path). Values are small integers, so every summation
order gives the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import MPIStrategy, ReduceOp, Variable, VariableAggregation as Agg
from mpidist._comm.algorithms import Hierarchical
from mpidist._comm.communicator import Communicator
from mpidist._comm.topology import Topology
from mpidist._comm.transport import Transport
from mpidist._options import Options
from test_comm import NUMERIC, contribution, defined, expected

pytestmark = pytest.mark.mpi

OPS_DTYPES = [
    (op, dt)
    for op in ("sum", "mean", "max", "prod")
    for dt in ["bool"] + NUMERIC
    if defined(op, dt) and not (dt == "bool" and op == "mean")
]


@pytest.fixture(scope="module")
def flat():
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024))
    yield c
    c.free()


@pytest.fixture(scope="module", params=[1, 2, 0], ids=["node1", "node2", "shared"])
def hier(request):
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024, hierarchical=True, node_size=request.param))
    yield c
    c.free()


def two_level(comm: MPI.Intracomm, options: Options, device_buffers: bool = False) -> tuple[Hierarchical, Topology]:
    """The two-level algorithm over ``comm`` (and the topology it may take its nodes from)."""
    topology = Topology(comm)
    return Hierarchical(Transport(comm, options), topology, device_buffers), topology


def test_groups_follow_the_forced_node_size(hier):
    h, topology = two_level(hier.mpi_comm, hier.options)
    k = hier.options.node_size or hier.size  # one machine: the shared-memory node holds every rank
    assert hier.mpi_comm.allreduce(int(h.is_leader)) == -(-hier.size // k)
    assert h.node.size == min(k, hier.size - (hier.rank // k) * k) and h.node.rank == hier.rank % k
    assert h.is_leader == (hier.rank % k == 0)
    assert (h.leaders != MPI.COMM_NULL) == h.is_leader
    assert hier.num_nodes == 1 and (h.node is topology.node) == (hier.options.node_size == 0)
    h.free()
    topology.free()


def test_the_rule_picks_the_same_algorithm_on_every_rank(flat, hier):
    for c, kind in ((flat, "Flat"), (hier, "Hierarchical")):
        for nbytes in (0, 8, 1 << 30):
            picked = type(c._algorithms.choose(nbytes)).__name__
            assert picked == kind
            assert c.mpi_comm.allgather(picked) == [kind] * c.size


@pytest.mark.parametrize("op,dtype", OPS_DTYPES)
def test_hierarchical_equals_flat(flat, hier, op, dtype):
    for shape in [(), (5,), (37, 101)]:  # one call; several pieces with a ragged last one
        want = flat.allreduce(contribution(flat.rank, shape, dtype), op)
        np.testing.assert_array_equal(want, expected(op, flat.size, shape, dtype) if dtype != "bool" else want)
        for _ in range(2):
            np.testing.assert_array_equal(hier.allreduce(contribution(hier.rank, shape, dtype), op), want)
            inplace = contribution(hier.rank, shape, dtype)
            hier.allreduce(inplace, op, inplace=True)
            np.testing.assert_array_equal(inplace, want)
            np.testing.assert_array_equal(hier.iallreduce(contribution(hier.rank, shape, dtype), op).wait(), want)


def test_hierarchical_fused_paths(flat, hier):
    fused = hier
    arrays = [contribution(hier.rank, shape, "float32") for shape in [(3,), (600,), (), (2, 2)]]
    want = [flat.allreduce(a, "mean") for a in arrays]
    for _ in range(2):
        for got in (
            fused.allreduce_many(arrays, ReduceOp.MEAN, list("abcd")),
            fused.iallreduce_many(arrays, ReduceOp.MEAN, list("abcd")).wait(),
        ):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
        targets = [np.zeros_like(a) for a in arrays]
        fused.reduce_apply(arrays, targets, [ReduceOp.MEAN] * 4, lambda t, r: t.__iadd__(r), list("abcd"))
        for t, w in zip(targets, want):
            np.testing.assert_array_equal(t, w)


def test_hierarchical_with_timeout_and_strategy():
    s = MPIStrategy(device="cpu", hierarchical=True, node_size=2, timeout=30.0, piece_bytes=1024)
    n, r = s.num_replicas_in_sync, s.rank
    with s.scope():
        v = Variable(np.zeros(1000), aggregation=Agg.MEAN, name="h")
        for _ in range(2):
            s.run(lambda: v.assign_add(contribution(r, (1000,), "float64")))
    np.testing.assert_array_equal(v.numpy(), 2 * expected("mean", n, (1000,), "float64"))
    np.testing.assert_array_equal(s.reduce("sum", np.arange(700, dtype=np.int64)), n * np.arange(700))
    s.free()


def test_free_releases_the_sub_communicators():
    base = MPI.COMM_WORLD.Dup()
    h, topology = two_level(base, Options(hierarchical=True, node_size=1))
    h.free()
    assert h.node == MPI.COMM_NULL and h.leaders == MPI.COMM_NULL
    assert topology.node != MPI.COMM_NULL  # not the algorithm's to free
    topology.free()
    assert topology.node == MPI.COMM_NULL
    base.Free()


@pytest.mark.parametrize("op", ["max", "min", "sum"])
def test_two_leaders_give_every_rank_the_same_bits(op):
    """Between two leaders each combines the other's piece with its own. NaN makes the operands' order show
    (MAX and MIN return whichever operand the comparison with NaN leaves; a sum keeps one NaN's payload), so both
    leaders must combine the same operands in the same places, or the ranks of one node would hold other values
    than those of the other. Many pieces (1 KiB), more than cross at once; with a timeout (the polled path)."""
    size, rank = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024, hierarchical=True, node_size=-(-size // 2)))
    x = np.arange(20_000, dtype=np.float64)
    bits = x.view(np.uint64)
    bits[rank % 2 :: 2] = 0x7FF8_0000_0000_0000 | (rank + 1)  # NaN of this rank's payload at every other element
    got = c.allreduce(x, op).view(np.uint64)
    every = MPI.COMM_WORLD.allgather(got.tobytes())
    assert every == [got.tobytes()] * size
    assert np.isnan(got.view(np.float64)).any()
    c.free()


@pytest.mark.parametrize("op", [ReduceOp.MEAN, ReduceOp.SUM, ReduceOp.MAX])
def test_fused_updates_of_many_pieces(flat, hier, op):
    """A fused update of an array of many pieces takes the two-level pipeline three ways: into ``out=``, in
    the input (``in_place``), and through a copy of the input with the update applied as each piece lands;
    each gives what the flat algorithm gives, and leaves the input as the path says."""
    shape = (41, 97)  # float64: 31 pieces of 1 KiB, the last ragged
    send = contribution(hier.rank, shape, "float64")
    want = flat.allreduce(send, op.value)
    got = hier.allreduce_many([send], op, ["x"], out=[np.empty(shape)])[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(send, contribution(hier.rank, shape, "float64"))  # out=: the input untouched
    target = np.ones(shape)
    hier.reduce_apply([send], [target], [op], lambda t, r: t.__iadd__(r), ["x"])
    np.testing.assert_array_equal(target, 1 + want)
    np.testing.assert_array_equal(send, contribution(hier.rank, shape, "float64"))
    target = np.ones(shape)
    hier.reduce_apply([send], [target], [op], lambda t, r: t.__isub__(r), ["x"], in_place=True)
    np.testing.assert_array_equal(target, 1 - want)
    np.testing.assert_array_equal(send, want)  # in place: the input holds the result


@pytest.mark.parametrize("device_buffers", [False, True], ids=["pairs", "allreduces"])
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_the_pipeline_crossing_either_way(device_buffers, timeout):
    """The pipeline's pieces cross between two leaders as messages both ways, or (where MPI may be handed device
    memory) as allreduces; either way, blocking or polled, every piece holds the sum and ``reduced`` sees each
    piece once, in order, after it landed."""
    size = MPI.COMM_WORLD.size
    options = Options(piece_bytes=1024, hierarchical=True, node_size=-(-size // 2), timeout=timeout)
    h, topology = two_level(MPI.COMM_WORLD.Dup(), options, device_buffers)
    x = contribution(MPI.COMM_WORLD.rank, (7001,), "int64")
    want = expected("sum", size, (7001,), "int64")
    ranges = h.pieces(x)
    pieces = [x[lo:hi] for lo, hi in ranges]
    seen = []

    def reduced(k):
        lo, hi = ranges[k]
        np.testing.assert_array_equal(pieces[k], want[lo:hi])
        seen.append(k)

    h.reduce_pieces("a test", pieces, MPI.SUM, reduced)
    assert seen == list(range(len(pieces))) and len(pieces) > 16  # more pieces than cross at once
    np.testing.assert_array_equal(x, want)
    comm = h.transport.comm
    h.free()
    topology.free()
    comm.Free()
