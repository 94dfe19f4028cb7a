"""Fused, pipelined and nonblocking reductions give what a plain reduction gives (1, 2 and 3 ranks).

Expected values come from rank and size (``contribution``/``expected`` of
test_comm), and every fused result is also compared with one plain
``Communicator.allreduce`` per array. Small ``piece_bytes`` and
``fusion_bytes`` make a few arrays exercise every path: buckets of packed
arrays, arrays reduced where they are in several pieces, and runs of arrays that
lie back to back in one buffer. Every rank makes the same calls in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import assert_equal, host
from mpidist import CollectiveMismatchError, MPIStrategy, ReduceOp, Variable, VariableAggregation as Agg
from mpidist._comm.communicator import Communicator
from mpidist._comm.flat_store import FlatStore, joinable
from mpidist._options import Options
from test_comm import NUMERIC, contribution, defined, expected

pytestmark = pytest.mark.mpi

DTYPES = ["bool"] + NUMERIC
SHAPES = [(), (3,), (0,), (2, 5), (700,), (9, 31)]  # small, empty, and several pieces of 1 KiB
OPS = ["sum", "mean", "min", "max", "prod", None]  # None: rank 0's value


@pytest.fixture(scope="module")
def fusion():
    comm = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024, fusion_bytes=256))
    yield comm
    comm.free()


def plain(comm: Communicator, array: np.ndarray, op) -> np.ndarray:
    if op is None:
        return comm.broadcast(array.copy(), root=0)
    return comm.allreduce(array, op)


def applicable(op, dtype: str) -> bool:
    return op is None or (defined(op, dtype) and not (dtype == "bool" and op == "mean"))


def inputs(comm: Communicator, dtype: str, flat: bool) -> list[np.ndarray]:
    """This rank's arrays of SHAPES; with ``flat`` they lie back to back in one buffer."""
    arrays = [contribution(comm.rank, shape, dtype) for shape in SHAPES]
    if not flat:
        return arrays
    store = FlatStore(np, slab_bytes=1 << 20)
    placed = [store.zeros(a.shape, a.dtype) for a in arrays]
    for p, a in zip(placed, arrays):
        p[...] = a
    return placed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_apply_matches_plain_reduction(fusion, dtype, flat, in_place):
    comm = fusion
    for op in [o for o in OPS if applicable(o, dtype)]:
        reduce_op = None if op is None else ReduceOp.of(op)
        for _ in range(2):
            sends = inputs(comm, dtype, flat)
            before = [s.copy() for s in sends]
            targets = inputs(comm, dtype, flat)
            if flat:  # back to back, except around the empty array (numpy moves its pointer)
                assert [joinable(a, b) for a, b in zip(targets, targets[1:])] == [True, False, False, True, True]
            fusion.reduce_apply(
                sends,
                targets,
                [reduce_op] * len(sends),
                lambda t, r: t.__setitem__(Ellipsis, r),
                [f"a{i}" for i in range(len(sends))],
                in_place,
            )
            for i, (send, target) in enumerate(zip(sends, targets)):
                want = plain(comm, before[i], op)
                np.testing.assert_array_equal(target, want, err_msg=f"{op} array {i}")
                np.testing.assert_array_equal(send, want if in_place else before[i])


def test_reduce_apply_mixed_ops_and_dtypes(fusion):
    comm = fusion
    n = comm.size
    specs = [
        ("float32", ReduceOp.MEAN),
        ("int64", ReduceOp.SUM),
        ("float32", ReduceOp.SUM),
        ("float64", None),
        ("float32", ReduceOp.MEAN),
        ("int64", ReduceOp.SUM),
    ]
    for _ in range(2):
        sends = [contribution(comm.rank, (300,), dt) for dt, _ in specs]
        targets = [np.ones(300, dt) for dt, _ in specs]
        fusion.reduce_apply(sends, targets, [op for _, op in specs], lambda t, r: t.__iadd__(r), list("abcdef"))
        for (dt, op), target in zip(specs, targets):
            want = 1 + (contribution(0, (300,), dt) if op is None else expected(op.value, n, (300,), dt))
            np.testing.assert_array_equal(target, want.astype(dt))


@pytest.mark.parametrize("dtype", ["float64", "int32", "float32"])
@pytest.mark.parametrize("in_place", [False, True])
def test_packed_buckets_and_pieces_in_turn(fusion, dtype, in_place):
    """Several full buckets of packed arrays, then pieces of a large one, then a bucket again."""
    comm = fusion
    shapes = [(30,)] * 10 + [(700,)] + [(29,)] * 3  # 3 packed buckets (float64), pieces, one more bucket
    for op in ["sum", "mean", "max", None]:
        if not applicable(op, dtype):
            continue
        sends = [contribution(comm.rank, shape, dtype) + i for i, shape in enumerate(shapes)]
        before = [s.copy() for s in sends]
        targets = [np.ones(shape, dtype) for shape in shapes]
        fusion.reduce_apply(
            sends,
            targets,
            [None if op is None else ReduceOp.of(op)] * len(sends),
            lambda t, r: t.__iadd__(r),
            [f"p{i}" for i in range(len(sends))],
            in_place,
        )
        for i, (send, target) in enumerate(zip(sends, targets)):
            want = plain(comm, before[i], op)
            np.testing.assert_array_equal(target, 1 + want, err_msg=f"{op} array {i}")
            np.testing.assert_array_equal(send, want if in_place else before[i], err_msg=f"{op} send {i}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_many_and_nonblocking_match_plain(fusion, dtype):
    comm = fusion
    for op in [o for o in OPS if o is not None and applicable(o, dtype)]:
        for _ in range(2):
            arrays = [contribution(comm.rank, shape, dtype) for shape in SHAPES]
            want = [plain(comm, a, op) for a in arrays]
            got = fusion.allreduce_many(arrays, ReduceOp.of(op), [f"a{i}" for i in range(len(arrays))])
            out = [np.full_like(a, 7) for a in arrays]  # into the caller's arrays: large ones reduced in place there
            into = fusion.allreduce_many(arrays, ReduceOp.of(op), [f"a{i}" for i in range(len(arrays))], out=out)
            assert all(i is o for i, o in zip(into, out))
            own = [contribution(comm.rank, shape, dtype) for shape in SHAPES]  # out= the inputs: in place
            results = fusion.allreduce_many(own, ReduceOp.of(op), list("abcdef"), out=own)
            assert all(r is a for r, a in zip(results, own))
            handle = fusion.iallreduce_many(arrays, ReduceOp.of(op), [f"a{i}" for i in range(len(arrays))])
            for a in arrays:
                a[...] = 0  # the nonblocking call copied its inputs when it started
            later = handle.wait()
            for g, h, o, w in zip(got, later, out, want):
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_array_equal(g, w)
                np.testing.assert_array_equal(o, w)
                np.testing.assert_array_equal(h, w)
            for a, w in zip(own, want):
                np.testing.assert_array_equal(a, w)
            assert handle.test() and handle.wait() is later


def test_fused_mismatch_names_the_array_and_modifies_nothing(fusion):
    comm = fusion
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    sends = [np.ones(3), np.ones(4 + comm.rank % 2), np.ones(2)]
    targets = [np.zeros(s.shape) for s in sends]
    with pytest.raises(CollectiveMismatchError) as info:
        fusion.reduce_apply(sends, targets, [ReduceOp.SUM] * 3, lambda t, r: t.__iadd__(r), ["w", "b", "c"])
    message = str(info.value)
    assert "array #1" in message and "'b' sum float64[4]" in message and "'b' sum float64[5]" in message
    assert all((t == 0).all() for t in targets)
    with pytest.raises((TypeError, CollectiveMismatchError)) as info:  # an invalid array on the last rank
        bad = np.ones((4, 4))[:, ::2] if comm.rank == comm.size - 1 else np.ones((4, 2))
        fusion.allreduce_many([np.ones(2), bad], ReduceOp.SUM, ["ok", "strided"])
    if comm.rank == comm.size - 1:
        assert isinstance(info.value, TypeError) and "'strided'" in str(info.value)
    else:
        assert "could not take part" in str(info.value)
    np.testing.assert_array_equal(
        fusion.allreduce_many([np.ones(1), np.ones(2)], ReduceOp.SUM, ["x", "y"])[1], [comm.size] * 2
    )  # still in step


# -- the strategy's fused paths ----------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["arrays", "flat"])
def strategy(request):
    s = MPIStrategy(device="cpu", flat_variables=request.param, piece_bytes=2048, fusion_bytes=512)
    yield s
    s.free()


def reduced(n: int, dtype: str, shape, agg: Agg) -> np.ndarray:
    """What ``n`` ranks' contributions aggregate to."""
    if agg is Agg.ONLY_FIRST_REPLICA:
        return contribution(0, shape, dtype)
    return expected("sum" if agg is Agg.SUM else "mean", n, shape, dtype)


def assert_identical_on_all_ranks(strategy, arrays):
    raw = np.concatenate([np.frombuffer(host(a).tobytes(), dtype=np.uint8) for a in arrays])
    rows = strategy.gather(md.PerReplica({strategy.rank: raw[None, :]}))
    assert all((row == rows[0]).all() for row in rows)


@pytest.mark.parametrize("fn", ["assign_add", "assign_sub", "assign", "scaled"])
def test_batch_update_equals_one_update_per_variable(strategy, fn):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    specs = [
        ("float32", (5, 7), Agg.MEAN),
        ("float64", (), Agg.SUM),
        ("int32", (3,), Agg.SUM),
        ("float32", (900,), Agg.MEAN),
        ("float16", (4,), Agg.ONLY_FIRST_REPLICA),
        ("complex64", (2, 2), Agg.SUM),
        ("float32", (11,), Agg.MEAN),
        ("int64", (1000,), Agg.SUM),
    ]
    update = (lambda w, g: w.__isub__(g * 2)) if fn == "scaled" else fn
    with strategy.scope():
        fused = [
            Variable(contribution(0, shape, dt), aggregation=agg, name=f"v{i}")
            for i, (dt, shape, agg) in enumerate(specs)
        ]
        single = [
            Variable(contribution(0, shape, dt), aggregation=agg, name=f"s{i}")
            for i, (dt, shape, agg) in enumerate(specs)
        ]
        grads = strategy.flat_zeros_like(fused)
        if strategy.options.flat_variables:
            assert all(joinable(a.component, b.component) for a, b in zip(fused[:4], fused[1:4]) if a.dtype == b.dtype)
        for _ in range(2):
            for g, (dt, shape, _) in zip(grads, specs):
                g[...] = contribution(r, shape, dt)
            for v, g in zip(single, grads):
                strategy.run(lambda: strategy.batch_update([(v, g)], update))
            assert strategy.run(lambda: strategy.batch_update(zip(fused, grads), update)) == fused
            for v, s, g, (dt, shape, _) in zip(fused, single, grads, specs):
                assert_equal(v.component, s.component)
                assert_equal(g, contribution(r, shape, dt))
            assert_identical_on_all_ranks(strategy, [v.component for v in fused])
            copies = [g.copy() for g in grads]
            strategy.run(lambda: strategy.batch_update(zip(fused, grads), update, in_place=True))
            strategy.run(lambda: strategy.batch_update(zip(single, copies), update))
            for v, s, g, (dt, shape, agg) in zip(fused, single, grads, specs):
                assert_equal(v.component, s.component)
                assert_equal(g, reduced(n, dt, shape, agg))  # in_place: the values now hold their aggregates
    if fn == "assign_add":  # and against the values derived from rank and size
        for v, (dt, shape, agg) in zip(fused, specs):
            assert_equal(v.component, (contribution(0, shape, dt) + 4 * reduced(n, dt, shape, agg)).astype(dt))


def test_batch_update_errors_name_the_variable(strategy):
    with strategy.scope():
        a = Variable(np.zeros(2), aggregation=Agg.SUM, name="a_ok")
        b = Variable(np.zeros(2), name="b_no_aggregation")
        c = Variable(np.zeros(3, np.int64), aggregation=Agg.SUM, name="c_int")
        with pytest.raises(ValueError, match="'b_no_aggregation' in replica context needs an aggregation"):
            strategy.run(lambda: strategy.batch_update([(a, np.ones(2)), (b, np.ones(2))]))
        with pytest.raises(TypeError, match="'c_int' has integer dtype"):
            strategy.run(lambda: strategy.batch_update([(a, np.ones(2)), (c, np.ones(3) / 2)]))
        strategy.batch_update([(a, np.ones(2)), (b, np.full(2, 3.0))])  # cross-replica: as given
        assert_equal(a.component, [1.0, 1.0])
        assert_equal(b.component, [3.0, 3.0])
        if strategy.num_replicas_in_sync > 1:
            with pytest.raises(CollectiveMismatchError, match="'c_int'"):
                pairs = (
                    [(a, np.ones(2)), (c, np.ones(3, np.int64))]
                    if strategy.rank
                    else [(a, np.ones(2)), (a, np.ones(2))]
                )
                strategy.run(lambda: strategy.batch_update(pairs))
            assert_equal(a.component, [1.0, 1.0])  # nothing was modified


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "complex128"])
def test_fused_reduce_of_a_nest_and_async(strategy, dtype):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    nest = {
        "a": [md.PerReplica({r: contribution(r, (700,), dtype)}), contribution(r, (3, 2), dtype)],
        "b": md.Mirrored({r: np.ones(4, dtype)}),
        "c": 2,
    }
    for op in ("sum", "mean"):
        want = {
            "a": [strategy.reduce(op, nest["a"][0]), strategy.reduce(op, nest["a"][1])],
            "b": strategy.reduce(op, nest["b"]),
            "c": strategy.reduce(op, 2),
        }
        got = strategy.reduce(op, nest)
        handle = strategy.reduce_async(op, nest)

        def in_replica():
            return md.get_replica_context().all_reduce(
                op, {"a": [nest["a"][0].get(), nest["a"][1]], "b": nest["b"], "c": 2}
            )

        with strategy.scope():
            replica = strategy.run(in_replica)
        later = handle.wait()
        for result in (got, later):
            for key, path in (("a", 0), ("a", 1)):
                assert_equal(result[key][path], want[key][path])
            assert_equal(result["b"], want["b"])
            assert_equal(result["c"], want["c"])
        assert_equal(replica["a"][0].get(), want["a"][0])
        assert_equal(want["b"], np.full(4, n if op == "sum" else 1))


def test_flat_variables_stay_ordinary(strategy):
    with strategy.scope():
        v = Variable(np.arange(6.0).reshape(2, 3), aggregation=Agg.MEAN, name="ordinary")
        v.assign_add(np.ones((2, 3)))
        strategy.run(lambda: v.assign_sub(np.ones((2, 3))))
    assert v.shape == (2, 3) and v.dtype == np.float64 and v.component.flags.c_contiguous
    assert_equal(v.numpy(), np.arange(6.0).reshape(2, 3))
    assert_equal(v + 1, np.arange(6.0).reshape(2, 3) + 1)
    assert (v.component.base is not None) == strategy.options.flat_variables


def _add(target, reduced):
    target += reduced


def _sub(target, reduced):
    target -= reduced


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "bool"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_prepared_update_applies_what_reduce_apply_applies(fusion, dtype, op):
    # The short path of one variable's small updates gives the general path's values, bit for bit, and is
    # offered only where the agreement record carries the data.
    if not applicable(op, dtype):
        pytest.skip(f"{op} is not defined for {dtype}")
    n, r = fusion.size, fusion.rank
    reduce_op = ReduceOp.of(op)
    update = fusion.prepare_update(np.zeros((2, 3), dtype), reduce_op, _add, "prepared")
    if dtype == "int32" and op == "sum" and fusion.options.check_overflow:  # checked sums: the general path
        assert update is None
        return
    assert update is not None
    once = np.zeros((2, 3), dtype)
    update(contribution(r, (2, 3), dtype), once)
    assert_equal(once, expected(op, n, (2, 3), dtype))
    general, short = np.zeros((2, 3), dtype), np.zeros((2, 3), dtype)
    for step in range(3):
        send = contribution(r + step, (2, 3), dtype)
        fusion.reduce_apply((send,), (general,), (reduce_op,), _add, ("prepared",))
        update(send, short)
        assert_equal(short, general)
        assert_equal(send, contribution(r + step, (2, 3), dtype))  # the send is left as it was


def test_prepared_update_is_only_for_small_host_sums_with_checks_on(fusion):
    small = np.zeros(4, np.float32)
    assert fusion.prepare_update(np.zeros(1000, np.float32), ReduceOp.SUM, _add, "big") is None  # not carried
    assert fusion.prepare_update(small, None, _add, "first") is None  # rank 0's value: a broadcast
    assert fusion.prepare_update(small, ReduceOp.MAX, _add, "max") is None
    assert fusion.prepare_update(small[::2], ReduceOp.SUM, _add, "strided") is None
    unchecked = Communicator(MPI.COMM_WORLD, Options(check_collectives=False, timeout=None))
    compressed = Communicator(MPI.COMM_WORLD, Options(compression="fp16"))
    overflow = Communicator(MPI.COMM_WORLD, Options(check_overflow=True))
    try:
        assert unchecked.prepare_update(small, ReduceOp.SUM, _add, "unchecked") is None  # no record to carry it
        assert compressed.prepare_update(small, ReduceOp.MEAN, _add, "fp16") is None
        assert compressed.prepare_update(np.zeros(4), ReduceOp.MEAN, _add, "float64") is not None
        assert overflow.prepare_update(np.zeros(4, np.int32), ReduceOp.SUM, _add, "int32") is None
        assert overflow.prepare_update(small, ReduceOp.SUM, _add, "float32") is not None
    finally:
        overflow.free()
        compressed.free()
        unchecked.free()


def test_prepared_and_general_updates_agree_on_the_call(fusion):
    # Ranks pair a prepared update with the same call made through reduce_apply, and tell its update function
    # and name apart from another's: CollectiveMismatchError on every rank, and no target changes.
    n, r = fusion.size, fusion.rank
    update = fusion.prepare_update(np.zeros(2), ReduceOp.SUM, _add, "paired")
    target, send = np.zeros(2), np.full(2, r + 1.0)
    if r % 2:
        fusion.reduce_apply((send,), (target,), (ReduceOp.SUM,), _add, ("paired",))
    else:
        update(send, target)
    assert_equal(target, np.full(2, n * (n + 1) / 2))
    if n == 1:
        return
    other = fusion.prepare_update(np.zeros(2), ReduceOp.SUM, _sub if r == n - 1 else _add, "paired")
    with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}.*_sub"):
        other(send, target)
    renamed = fusion.prepare_update(np.zeros(2), ReduceOp.SUM, _add, "renamed" if r == 0 else "paired")
    with pytest.raises(CollectiveMismatchError, match="'renamed'"):
        renamed(send, target)
    assert_equal(target, np.full(2, n * (n + 1) / 2))
