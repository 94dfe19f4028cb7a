"""The opt-in integer overflow check (``check_overflow``), under mpiexec (1, 2 and 3 ranks).

Each rank contributes values whose sum fits the dtype at some world sizes and
not at others, so the expected outcome (the exact sum, or an
``IntegerOverflowError`` naming the elements) is derived from the size. Every
rank makes the same calls in the same order, also where they raise; after a
refusal nothing was written and the communicator goes on working.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from mpidist import IntegerOverflowError
from mpidist._comm import overflow
from mpidist._comm.communicator import Communicator
from mpidist._comm.reduce_op import ReduceOp
from mpidist._options import Options

SIZE = MPI.COMM_WORLD.size


@pytest.fixture(scope="module")
def comm():
    c = Communicator(MPI.COMM_WORLD, Options.resolve(env={}, check_overflow=True, piece_bytes=1024))
    yield c
    c.free()


def exact_sums(values: list[int]) -> list[int]:
    """Python-integer sums of ``values`` contributed by every rank."""
    return [v * SIZE for v in values]


def overflowing(values: list[int], dtype: str) -> list[int]:
    info = np.iinfo(dtype)
    return [i for i, s in enumerate(exact_sums(values)) if not info.min <= s <= info.max]


# (dtype, one rank's values): 100 and -100 overflow int8 from 2 ranks on, 60 from 3 ranks on, and so on.
CASES = [
    ("int8", [100, -100, 60, 1, 0]),
    ("uint8", [200, 90, 1]),
    ("int16", [20000, -12000, 7]),
    ("int32", [2**30, -(2**30) - 1, 2**29, 5]),
    ("uint32", [2**31, 2**31 - 1, 3]),
    ("int64", [2**62, -(2**62), 2**61, -(2**61) - 3, 2**40 + 7]),
    ("uint64", [2**63, 2**62 + 5, 2**40]),
]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype,values", CASES)
@pytest.mark.parametrize("length", [1, 40])  # 40 repeats: beyond the agreement's carried slots, in pieces
def test_allreduce_gives_the_exact_sum_or_refuses_on_every_rank(comm, dtype, values, length):
    mine = np.array(values * length, dtype=dtype)
    out = np.full_like(mine, 9)
    bad = overflowing(values, dtype)
    if not bad:
        comm.allreduce(mine, "sum", out=out, name="counts")
        assert out.tolist() == exact_sums(values) * length
        return
    with pytest.raises(IntegerOverflowError, match=f"SUM of 'counts' does not fit dtype {dtype}") as info:
        comm.allreduce(mine, "sum", out=out, name="counts")
    assert info.value.name == "counts" and list(info.value.indices[: len(bad)]) == bad
    assert (out == 9).all()  # nothing written
    np.testing.assert_array_equal(comm.allreduce(np.ones(3, np.int64)), np.full(3, SIZE))  # still usable


@pytest.mark.mpi
def test_nonblocking_in_place_and_reduce_scatter_are_checked(comm):
    values = [100, 60, -7]
    bad = overflowing(values, "int8")
    mine = np.array(values, dtype=np.int8)
    handle_input = mine.copy()
    if bad:
        with pytest.raises(IntegerOverflowError):
            comm.iallreduce(handle_input, "sum", inplace=True).wait()
        assert handle_input.tolist() == values  # in place, and still untouched
        with pytest.raises(IntegerOverflowError):
            comm.reduce_scatter(np.array([values] * SIZE, dtype=np.int8), "sum")
    else:
        assert comm.iallreduce(handle_input, "sum", inplace=True).wait().tolist() == exact_sums(values)
        assert comm.reduce_scatter(np.array([values] * SIZE, dtype=np.int8), "sum").tolist() == [exact_sums(values)]
    # a fused list: the float array is not written either when an integer sum is refused
    floats, ints = np.full(3, float(comm.rank)), np.array(values * 20, dtype=np.int8)
    outs = [np.zeros(3), np.zeros(60, np.int8)]
    if bad:
        with pytest.raises(IntegerOverflowError, match="'ints'"):
            comm.allreduce_many([floats, ints], "sum", ["floats", "ints"], out=outs)
        assert not outs[0].any() and not outs[1].any()
    else:
        comm.allreduce_many([floats, ints], "sum", ["floats", "ints"], out=outs)
        assert outs[0].tolist() == [SIZE * (SIZE - 1) / 2] * 3 and outs[1].tolist() == exact_sums(values) * 20


@pytest.mark.mpi
def test_without_the_check_integer_sums_wrap_as_in_mpi():
    c = Communicator(MPI.COMM_WORLD, Options.resolve(env={}))
    values = [100, -100, 60]
    wrapped = (np.array(exact_sums(values)) + 128) % 256 - 128
    assert c.allreduce(np.array(values, dtype=np.int8), "sum").tolist() == wrapped.tolist()
    c.free()


@pytest.mark.mpi
def test_a_mirrored_update_that_overflows_leaves_every_variable_as_it_was():
    strategy = md.MPIStrategy(device="cpu", check_overflow=True)
    with strategy.scope():
        count = md.Variable(np.zeros(2, np.int32), aggregation="sum", name="count")
        weight = md.Variable(np.ones(2), aggregation="mean", name="weight")
    step = np.array([2**30, 1], dtype=np.int32)  # 2**30 * size overflows int32 from 2 ranks on

    def update():
        strategy.batch_update([(weight, np.full(2, 3.0)), (count, step)])

    if SIZE >= 2:
        with pytest.raises(IntegerOverflowError, match="'count'"):
            strategy.run(update)
        assert count.numpy().tolist() == [0, 0] and weight.numpy().tolist() == [1.0, 1.0]
    else:
        strategy.run(update)
        assert count.numpy().tolist() == [2**30, 1] and weight.numpy().tolist() == [4.0, 4.0]
    with strategy.scope():
        total = md.Variable(np.zeros(1, np.int8), synchronization="on_read", aggregation="sum", name="total")
    strategy.run(lambda: total.assign(np.array([100], np.int8)))
    with strategy.scope():
        if SIZE >= 2:
            with pytest.raises(IntegerOverflowError, match="'total'"):
                strategy.read_var(total)
        else:
            assert strategy.read_var(total).tolist() == [100]
    strategy.free()


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "int64", "uint64"])
def test_widen_and_narrow_round_trip_the_extremes(dtype):
    info = np.iinfo(dtype)
    x = np.array([info.min, info.max, 0, 1, info.max // 3], dtype=dtype)
    assert overflow.narrow(overflow.widen(x), np.dtype(dtype), "x", 0).tolist() == x.tolist()
    doubled = overflow.widen(x) * 2  # what two ranks contributing x sum to
    with pytest.raises(IntegerOverflowError) as info_:
        overflow.narrow(doubled, np.dtype(dtype), "x", 0)
    expect_bad = [i for i, v in enumerate(x.tolist()) if not info.min <= 2 * v <= info.max]
    assert list(info_.value.indices) == expect_bad
    assert overflow.applies(ReduceOp.SUM, np.dtype(dtype)) and not overflow.applies(ReduceOp.MAX, np.dtype(dtype))
