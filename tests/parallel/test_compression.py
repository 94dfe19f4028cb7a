"""Wire compression of float32 reductions (``compression="fp16"``/``"bf16"``) at 1, 2 and 3 ranks.

Each rank's input is random (seeded by its rank), so every rank computes the exact reference
(float64 sums of every rank's input) without communicating; results must lie within the bound of
docs/compression.md, be the same bits on every rank, and (for the flat algorithm) be 16-bit
values, rounded once. Exact mode stays bitwise what it was. An overflow raises NonFiniteError on
every rank; ranks that ask for different compressions disagree on the call. The two-level path
runs on one machine with a forced ``node_size``; ``piece_bytes=4096`` makes pieces of 1024
elements, so the larger sizes run in several pieces with a ragged last one. Every rank makes the
same calls in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import host
from mpidist import Variable, VariableAggregation as Agg
from mpidist._comm.communicator import Communicator
from mpidist._comm.compression import AHEAD, BEHIND
from mpidist._options import Options

pytestmark = pytest.mark.mpi

WIRES = ["fp16", "bf16"]
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}  # u: the unit roundoff of each 16-bit format
SIXTEEN = {"fp16": np.float16, "bf16": None}  # bf16: ml_dtypes' bfloat16, looked up in sixteen()
# sizes: below N (at 3 ranks), ragged over N, above the record's 32 data slots, several pieces, ragged pieces, more
# pieces than the pipeline's rows (40 of 1024 elements, the last ragged: compression.AHEAD + BEHIND + 1 rows)
SIZES = [1, 2, 5, 33, 1000, 1021, 4096, 5003, 40_003]


def sixteen(wire: str):
    import ml_dtypes

    return np.float16 if wire == "fp16" else ml_dtypes.bfloat16


def inputs(rank: int, n: int, scale: float = 1.0, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s float32 input of ``n`` elements: normal values of a few magnitudes, some tiny."""
    rng = np.random.default_rng(1000 * salt + rank)
    x = rng.standard_normal(n) * scale * np.exp2(rng.integers(-12, 4, n))
    return x.astype(np.float32)


def bound(wire: str, op: str, xs: list[np.ndarray], nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference (float64) and the bound of docs/compression.md for the reduction of ``xs``.

    |r - S| <= u|S| + (1 + u)(u + (1 + u) g) sum|x_i| + (nodes + 1) t, with g = (N - 1) 2**-24 (float32
    sums) and t the absolute error of one rounding below the normal range (2**-25 for fp16, whose
    subnormals begin at 2**-14; bfloat16's lie below float32's normal range, negligible here). MEAN
    divides S, sum|x_i| and t by N, and adds one float32 rounding of the quotient.
    """
    n = len(xs)
    u, g = UNIT[wire], (n - 1) * 2.0**-24
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    size = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    tiny = (nodes + 1) * (2.0**-25 if wire == "fp16" else 2.0**-133)
    if op == "mean":
        exact, size, tiny = exact / n, size / n, tiny / n
    tol = u * np.abs(exact) + (1 + u) * (u + (1 + u) * g) * size + tiny
    if op == "mean":
        tol += 2.0**-24 * np.abs(exact) * (1 + u)
    return exact, tol * (1 + 1e-6)


def assert_within(result, wire: str, op: str, xs: list[np.ndarray], nodes: int) -> None:
    exact, tol = bound(wire, op, xs, nodes)
    err = np.abs(host(result).astype(np.float64).reshape(-1) - exact)
    worst = int(np.argmax(err - tol)) if err.size else 0
    assert (err <= tol).all(), f"element {worst}: error {err[worst]:.3g} > bound {tol[worst]:.3g}"


def same_everywhere(comm: Communicator, result) -> None:
    bits = np.ascontiguousarray(host(result)).view(np.uint8).tobytes()
    assert len(set(comm.mpi_comm.allgather(bits))) == 1


@pytest.fixture(scope="module")
def comm():
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=4096))
    yield c
    c.free()


@pytest.fixture(scope="module")
def unchecked():
    """No agreement (and no timeout): small arrays reach the data path too, and MPI's blocking calls run."""
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=4096, check_collectives=False, timeout=None))
    yield c
    c.free()


@pytest.fixture(scope="module", params=[1, 2], ids=["node1", "node2"])
def two_level(request):
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=4096, hierarchical=True, node_size=request.param))
    yield c
    c.free()


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_within_the_bound_and_rounded_once(comm, unchecked, wire, op):
    assert max(SIZES) // 1024 > AHEAD + BEHIND + 1  # the pipeline reuses its rows
    for c in (comm, unchecked):
        for n in SIZES:
            xs = [inputs(r, n) for r in range(c.size)]
            got = c.allreduce(xs[c.rank], op, compression=wire)
            assert got.dtype == np.float32 and got.shape == (n,)
            assert_within(got, wire, op, xs, c.size)
            same_everywhere(c, got)
            if c.size > 1 and (c is unchecked or n > 32):  # not carried inside the record: 16-bit values
                np.testing.assert_array_equal(got.astype(sixteen(wire)).astype(np.float32), got)


@pytest.mark.parametrize("wire", WIRES)
def test_in_place_out_and_shapes(comm, wire):
    xs = [inputs(r, 7 * 301) for r in range(comm.size)]
    want = comm.allreduce(xs[comm.rank], "mean", compression=wire)
    mine = xs[comm.rank].reshape(7, 301).copy()
    out = np.empty_like(mine)
    assert comm.allreduce(mine, "mean", out=out, compression=wire) is out
    np.testing.assert_array_equal(out.reshape(-1), want)
    assert comm.allreduce(mine, "mean", inplace=True, compression=wire) is mine
    np.testing.assert_array_equal(mine.reshape(-1), want)


def test_exact_mode_is_unchanged(comm):
    plain = Communicator(MPI.COMM_WORLD, Options(piece_bytes=4096))
    try:
        for n in (33, 5003):
            x = inputs(comm.rank, n)
            want = plain.allreduce(x, "mean")
            for given in (None, "none", "NONE"):
                np.testing.assert_array_equal(comm.allreduce(x, "mean", compression=given), want)
    finally:
        plain.free()


@pytest.mark.parametrize("wire", WIRES)
def test_the_strategy_option_and_the_per_call_argument(wire):
    exact = Communicator(MPI.COMM_WORLD, Options(piece_bytes=4096))
    s = md.MPIStrategy(piece_bytes=4096, compression=wire)
    try:
        assert s.extended.communicator.options.compression == wire
        xs = [inputs(r, 3000, salt=1) for r in range(s.num_replicas_in_sync)]
        mine = xs[s.rank]
        by_option = s.reduce("mean", mine)
        assert_within(by_option, wire, "mean", xs, s.num_replicas_in_sync)
        np.testing.assert_array_equal(by_option, exact.allreduce(mine, "mean", compression=wire))
        # "none" on the call: exact, whatever the strategy says
        np.testing.assert_array_equal(s.reduce("mean", mine, compression="none"), exact.allreduce(mine, "mean"))
        # the option leaves other dtypes and ops exact (an explicit request for them is an error instead)
        wide = mine.astype(np.float64)
        np.testing.assert_array_equal(s.reduce("sum", wide), exact.allreduce(wide, "sum"))
        np.testing.assert_array_equal(s.reduce("max", mine), exact.allreduce(mine, "max"))
        # a nest: reduced together, compressed alike
        nest = {"a": mine[:1000], "b": mine[1000:].reshape(50, 40)}
        got = s.reduce("mean", nest)
        assert_within(np.concatenate([got["a"], got["b"].reshape(-1)]), wire, "mean", xs, s.num_replicas_in_sync)

        def replica(x):
            return md.get_replica_context().all_reduce("sum", x, compression=wire)

        in_replica = s.run(replica, args=(mine,))
        assert_within(
            in_replica.get(s.rank) if hasattr(in_replica, "get") else in_replica,
            wire,
            "sum",
            xs,
            s.num_replicas_in_sync,
        )
    finally:
        s.free()
        exact.free()


@pytest.mark.parametrize("wire", WIRES)
def test_mirrored_updates(wire):
    s = md.MPIStrategy(piece_bytes=4096)
    n = s.num_replicas_in_sync
    try:
        with s.scope():
            v = Variable(np.zeros(2500, np.float32), aggregation=Agg.MEAN, name="w")
            counts = Variable(np.zeros(4, np.float64), aggregation=Agg.SUM, name="counts")
        xs = [inputs(r, 2500, salt=2) for r in range(n)]
        s.run(lambda: s.batch_update([(v, xs[s.rank])], "assign_add", compression=wire))
        assert_within(v.numpy(), wire, "mean", xs, n)
        same_everywhere(s.extended.communicator, v.numpy())
        # several variables in one fused update, one of them not float32: an explicit request refuses it
        with pytest.raises(ValueError, match="applies to SUM and MEAN of float32 only; 'counts'"):
            s.run(lambda: s.batch_update([(v, xs[s.rank]), (counts, np.ones(4))], compression=wire))
    finally:
        s.free()
    option = md.MPIStrategy(piece_bytes=4096, compression=wire)
    try:
        with option.scope():
            v = Variable(np.zeros(2500, np.float32), aggregation=Agg.MEAN, name="w")
            counts = Variable(np.zeros(4, np.float64), aggregation=Agg.SUM, name="counts")
        option.run(lambda: v.assign_add(xs[option.rank]))
        assert_within(v.numpy(), wire, "mean", xs, n)
        option.run(lambda: v.assign(xs[option.rank]))
        assert_within(v.numpy(), wire, "mean", xs, n)
        # the option leaves the float64 counts exact within the same fused update
        option.run(lambda: option.batch_update([(v, xs[option.rank]), (counts, np.full(4, 0.1))]))
        np.testing.assert_array_equal(counts.numpy(), np.full(4, 0.1) * n if n > 1 else np.full(4, 0.1))
    finally:
        option.free()


@pytest.mark.parametrize("wire", WIRES)
def test_the_option_leaves_sync_on_read_reads_and_saves_exact(wire, shared_tmp):
    # statistics (and the checkpoint that saves them) are read exactly: an fp16 read of these sums, beyond 65504,
    # would raise NonFiniteError; a bf16 one would round them to 8 bits
    exact = Communicator(MPI.COMM_WORLD, Options(piece_bytes=4096))
    s = md.MPIStrategy(piece_bytes=4096, compression=wire)
    try:
        with s.scope():
            total = Variable(
                np.zeros(1000, np.float32), synchronization=md.VariableSynchronization.ON_READ, aggregation=Agg.SUM
            )
            mean = Variable(
                np.zeros(1000, np.float32), synchronization=md.VariableSynchronization.ON_READ, aggregation=Agg.MEAN
            )
        mine = (inputs(s.rank, 1000, scale=10_000.0, salt=3) + np.float32(70_001.5)).astype(np.float32)
        s.run(lambda: (total.assign(mine), mean.assign(mine)))
        want_total, want_mean = exact.allreduce(mine, "sum"), exact.allreduce(mine, "mean")
        with s.scope():
            np.testing.assert_array_equal(total.read_value(), want_total)
            np.testing.assert_array_equal(s.read_var(mean), want_mean)
        np.testing.assert_array_equal(total.numpy(), want_total)
        path = str(shared_tmp / "ckpt")
        md.Checkpoint(total=total, mean=mean).save(path)
        saved = md.read_checkpoint(path)
        np.testing.assert_array_equal(saved["total"], want_total)
        np.testing.assert_array_equal(saved["mean"], want_mean)
    finally:
        s.free()
        exact.free()


@pytest.mark.parametrize("wire", WIRES)
def test_fused_lists(comm, wire):
    sizes = [3, 40, 700, 2000, 9]  # small ones share a bucket, large ones run in pieces
    xs = {n: [inputs(r, n, salt=n) for r in range(comm.size)] for n in sizes}
    got = comm.allreduce_many([xs[n][comm.rank] for n in sizes], "sum", compression=wire)
    for n, result in zip(sizes, got):
        assert_within(result, wire, "sum", xs[n], comm.size)
        same_everywhere(comm, result)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_two_level_rounds_once_per_node(two_level, wire, op):
    k = two_level.options.node_size
    nodes = -(-two_level.size // k)
    for n in (40, 1021, 5003, 40_003):
        xs = [inputs(r, n, salt=3) for r in range(two_level.size)]
        got = two_level.allreduce(xs[two_level.rank], op, compression=wire)
        assert_within(got, wire, op, xs, two_level.size)
        same_everywhere(two_level, got)
        if nodes > 1:
            np.testing.assert_array_equal(got.astype(sixteen(wire)).astype(np.float32), got)


def test_an_fp16_overflow_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("one rank reduces nothing over a wire")
    big = np.full(100, 32768.0, np.float32)  # fits float16 (and bfloat16, exactly); the sum of two does not
    with pytest.raises(md.NonFiniteError, match=r"compression='fp16'.*Inf or NaN at 100 elements"):
        comm.allreduce(big, "sum", compression="fp16")
    # bfloat16 has float32's range
    np.testing.assert_array_equal(comm.allreduce(big, "sum", compression="bf16"), big * comm.size)
    # an input beyond float16's range on one rank only
    one = np.ones(100, np.float32)
    if comm.rank == comm.size - 1:
        one[7] = 1e6
    with pytest.raises(md.NonFiniteError, match="the first at flat index 7"):
        comm.allreduce(one, "mean", compression="fp16")
    comm.barrier()  # and the communicator goes on


@pytest.mark.parametrize("algorithm", [{}, {"hierarchical": True, "node_size": 1}], ids=["flat", "two_level"])
def test_a_large_update_that_overflows_applies_the_pieces_before_it_alike(algorithm):
    # 5000 elements in pieces of 1024, reduced as a pipeline and applied piece by piece as they land: the input
    # beyond float16's range (index 2500, piece 2) is refused on every rank once every piece was reduced, with
    # pieces 0-1 applied and no later one
    s = md.MPIStrategy(piece_bytes=4096, compression="fp16", **algorithm)
    try:
        if s.num_replicas_in_sync == 1:
            pytest.skip("one rank reduces nothing over a wire")
        with s.scope():
            v = Variable(np.ones(5000, np.float32), aggregation=Agg.MEAN, name="w")
        g = np.full(5000, 0.5, np.float32)
        if s.rank == s.num_replicas_in_sync - 1:
            g[2500] = 1e6
        with pytest.raises(md.NonFiniteError, match=r"Inf or NaN at 1 element \(the first at flat index 2500\)"):
            s.run(lambda: v.assign_add(g))
        got = v.numpy()
        np.testing.assert_array_equal(got[:2048], 1.5)
        np.testing.assert_array_equal(got[2048:], 1.0)
        same_everywhere(s.extended.communicator, got)
        s.run(lambda: v.assign_add(np.full(5000, 0.5, np.float32)))  # and the strategy goes on
        np.testing.assert_array_equal(v.numpy()[2048:], 1.5)
    finally:
        s.free()


def test_ranks_asking_for_different_compressions_disagree(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree")
    x = np.ones(100, np.float32)
    mine = "fp16" if comm.rank == 0 else "bf16" if comm.rank == 1 else "none"
    with pytest.raises(md.CollectiveMismatchError) as caught:
        comm.allreduce(x, "sum", compression=mine)
    text = str(caught.value)
    assert "rank 0: #" in text and "compressed to fp16" in text and "compressed to bf16" in text
    if comm.size > 2:
        assert "rank 2: #" in text
    with pytest.raises(md.CollectiveMismatchError, match="compression"):
        md.MPIStrategy(compression="fp16" if comm.rank == 0 else None).free()


def test_an_explicit_request_on_what_cannot_be_compressed_raises_everywhere(comm):
    with pytest.raises(ValueError, match="applies to SUM and MEAN of float32 only; 'd' is a SUM of float64"):
        comm.allreduce(np.ones(50), "sum", name="d", compression="fp16")
    with pytest.raises(ValueError, match="'m' is a MAX of float32"):
        comm.allreduce(np.ones(50, np.float32), "max", name="m", compression="bf16")
    first, target = np.ones(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"'w' is rank 0's value \(no reduction\) of float32\. Reduce it exactly"):
        comm.reduce_apply((first,), (target,), (None,), lambda t, r: t.__iadd__(r), ("w",), compression="fp16")
    assert not target.any()  # nothing applied
    with pytest.raises(ValueError, match="compression must be 'fp16', 'bf16', 'none' or None, got 'fp8'"):
        comm.allreduce(np.ones(50, np.float32), compression="fp8")
    comm.barrier()


@pytest.mark.gpu
@pytest.mark.parametrize("wire", WIRES)
def test_device_arrays(wire):
    import cupy

    c = Communicator(MPI.COMM_WORLD, Options.resolve(device="gpu", piece_bytes=4096))
    two = Communicator(MPI.COMM_WORLD, Options.resolve(device="gpu", piece_bytes=4096, hierarchical=True, node_size=1))
    try:
        for comm in (c, two):
            for n in (40, 5003):
                xs = [inputs(r, n, salt=4) for r in range(comm.size)]
                got = comm.allreduce(cupy.asarray(xs[comm.rank]), "mean", compression=wire)
                assert isinstance(got, cupy.ndarray)
                assert_within(got, wire, "mean", xs, comm.size)
                same_everywhere(comm, got)
            s = comm.allreduce_many([cupy.asarray(inputs(comm.rank, 3000))], "sum", compression=wire)[0]
            assert_within(s, wire, "sum", [inputs(r, 3000) for r in range(comm.size)], comm.size)
            if comm.size > 1 and wire == "fp16":  # a sum beyond float16's range, in the third piece of five
                big = np.ones(5000, np.float32)
                big[2100] = 40000.0
                with pytest.raises(md.NonFiniteError, match=r"at 1 element \(the first at flat index 2100\)"):
                    comm.allreduce(cupy.asarray(big), "sum", compression=wire)
    finally:
        two.free()
        c.free()
