"""Collectives of mpidist's Communicator, under mpiexec (1, 2 and 3 ranks).

Every expected value is derived from rank and size, so the same test holds at
any world size. Each check runs twice (lazy-initialisation bugs) over a
duplicate of COMM_SELF and of COMM_WORLD. Every rank makes the same calls in
the same order, also where a call is expected to fail.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import CollectiveMismatchError, CollectiveTimeoutError
from mpidist._comm import agreement, deadline
from mpidist._comm.communicator import Communicator
from mpidist._errors import format_ranks, on_rank
from mpidist._options import Options

pytestmark = pytest.mark.mpi

NUMERIC = ["int8", "int32", "int64", "uint8", "float16", "float32", "float64", "complex64", "complex128"]
FLOATS = ["float16", "float32", "float64", "complex64", "complex128"]


@pytest.fixture(scope="module", params=["self", "world"])
def comm(request):
    base = MPI.COMM_SELF if request.param == "self" else MPI.COMM_WORLD
    c = Communicator(base, Options.resolve(env={}))
    yield c
    c.free()


def contribution(rank: int, shape, dtype) -> np.ndarray:
    """Rank r's input: (r + 1) * (1, 2, 3, ...) reshaped; small enough for int8 sums."""
    n = int(np.prod(shape, dtype=np.int64))
    return ((rank + 1) * (np.arange(n) % 4 + 1)).reshape(shape).astype(dtype)


def expected(op: str, size: int, shape, dtype) -> np.ndarray:
    stack = np.stack([contribution(r, shape, dtype) for r in range(size)])
    if op == "mean":
        return (stack.sum(axis=0, dtype=dtype) / size).astype(dtype)
    fn = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    return fn(stack, axis=0).astype(dtype)


def defined(op: str, dtype: str) -> bool:
    """Whether ``op`` is defined for ``dtype`` (the undefined pairs are tested as errors)."""
    kind = np.dtype(dtype).kind
    return not ((op == "mean" and kind in "iub") or (op in ("min", "max") and kind == "c"))


OPS_DTYPES = [(op, dt) for op in ("sum", "prod", "min", "max", "mean") for dt in NUMERIC if defined(op, dt)]


@pytest.mark.parametrize("op,dtype", OPS_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5)])
def test_allreduce_ops_dtypes_shapes(comm, op, dtype, shape):
    want = expected(op, comm.size, shape, dtype)
    for _ in range(2):
        mine = contribution(comm.rank, shape, dtype)
        out = comm.allreduce(mine, op)
        assert out.dtype == np.dtype(dtype) and out.shape == tuple(shape)
        np.testing.assert_allclose(out, want, rtol=1e-3 if dtype == "float16" else 1e-7)
        np.testing.assert_array_equal(mine, contribution(comm.rank, shape, dtype))  # input untouched


@pytest.mark.parametrize("mode", ["inplace", "out"])
def test_allreduce_inplace_and_out(comm, mode):
    want = expected("sum", comm.size, (4, 3), "float64")
    for _ in range(2):
        mine = contribution(comm.rank, (4, 3), "float64")
        if mode == "inplace":
            result = comm.allreduce(mine, "sum", inplace=True)
            assert result is mine
        else:
            out = np.empty_like(mine)
            result = comm.allreduce(mine, "sum", out=out)
            assert result is out
        np.testing.assert_array_equal(result, want)


def test_allreduce_bool(comm):
    mine = np.array([comm.rank == 0, True, False, comm.rank == comm.size - 1])
    any_ = np.array([True, True, False, True])
    all_ = np.array([comm.size == 1, True, False, comm.size == 1])
    for _ in range(2):
        np.testing.assert_array_equal(comm.allreduce(mine, "sum"), any_)
        np.testing.assert_array_equal(comm.allreduce(mine, "max"), any_)
        np.testing.assert_array_equal(comm.allreduce(mine, "min"), all_)
        np.testing.assert_array_equal(comm.allreduce(mine, "prod"), all_)


@pytest.mark.parametrize(
    "op,dtype",
    [
        (op, dt)
        for op in ("sum", "mean", "max")
        for dt in ("int32", "float32", "float64", "complex128")
        if defined(op, dt)
    ],
)
def test_pipelined_allreduce_matches_single_call(op, dtype):
    piecewise = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024))
    whole = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1 << 30))
    shape = (37, 101)  # 3737 elements: several pieces plus a ragged last one
    for _ in range(2):
        a = piecewise.allreduce(contribution(piecewise.rank, shape, dtype), op)
        b = whole.allreduce(contribution(whole.rank, shape, dtype), op)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, expected(op, piecewise.size, shape, dtype))
        inplace = contribution(piecewise.rank, shape, dtype)
        piecewise.allreduce(inplace, op, inplace=True)
        np.testing.assert_array_equal(inplace, b)
    piecewise.free()
    whole.free()


def test_nonblocking_collectives(comm):
    for _ in range(2):
        a = contribution(comm.rank, (1000,), "float32")
        h1 = comm.iallreduce(a, "sum")
        b = np.full(5, comm.rank, dtype=np.int64)
        h2 = comm.ibroadcast(b, root=comm.size - 1)
        h3 = comm.iallgather(np.full(comm.rank + 1, comm.rank, dtype=np.int32))
        np.testing.assert_array_equal(h3.wait(), np.repeat(np.arange(comm.size), np.arange(1, comm.size + 1)))
        np.testing.assert_array_equal(h2.wait(), np.full(5, comm.size - 1))
        np.testing.assert_array_equal(h1.wait(), expected("sum", comm.size, (1000,), "float32"))
        assert h1.test() and h1.wait() is h1.wait()  # waiting again returns the same result


def test_handles_polled_with_test_until_done(comm):
    """``handle.test()`` before ``wait()``, polled until it says done: the agreement's persistent request and the
    data stage's requests are tested one by one (MPICH's Testall fails on the persistent request at one rank)."""
    for small in (True, False):
        a = contribution(comm.rank, (3,) if small else (100_000,), "float64")
        handles = [comm.iallreduce(a, "sum"), comm.iallgather(np.full(2, comm.rank, dtype=np.int32))]
        while not all(h.test() for h in handles):
            pass
        np.testing.assert_array_equal(handles[0].wait(), expected("sum", comm.size, a.shape, "float64"))
        np.testing.assert_array_equal(handles[1].wait(), np.repeat(np.arange(comm.size, dtype=np.int32), 2))


@pytest.mark.parametrize("dtype", ["bool", "int64", "float16", "complex64"])
def test_broadcast_from_every_root(comm, dtype):
    for _ in range(2):
        for root in range(comm.size):
            mine = contribution(comm.rank, (2, 3), dtype)
            out = comm.broadcast(mine, root=root)
            assert out is mine
            np.testing.assert_array_equal(out, contribution(root, (2, 3), dtype))


def test_broadcast_zero_d_and_empty(comm):
    for _ in range(2):
        np.testing.assert_array_equal(comm.broadcast(np.array(float(comm.rank))), 0.0)
        assert comm.broadcast(np.empty((0, 3))).shape == (0, 3)


@pytest.mark.parametrize("dtype", ["bool", "int32", "float16", "float64", "complex128"])
def test_allgather_equal_and_unequal_lengths(comm, dtype):
    for _ in range(2):
        equal = comm.allgather(contribution(comm.rank, (2, 3), dtype))
        np.testing.assert_array_equal(equal, np.concatenate([contribution(r, (2, 3), dtype) for r in range(comm.size)]))
        unequal = comm.allgather(contribution(comm.rank, (comm.rank, 2), dtype))  # rank 0 sends nothing
        assert unequal.shape == (sum(range(comm.size)), 2)
        want = np.concatenate([contribution(r, (r, 2), dtype) for r in range(comm.size)])
        np.testing.assert_array_equal(unequal, want)
        scalars = comm.allgather(np.array(comm.rank * 10, dtype=np.int64))
        np.testing.assert_array_equal(scalars, np.arange(comm.size) * 10)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reduce_scatter(comm, op):
    rows = 2 * comm.size + 1
    full = expected(op, comm.size, (rows, 2), "float64")
    counts = comm.split_counts(rows)
    start = sum(counts[: comm.rank])
    for _ in range(2):
        block = comm.reduce_scatter(contribution(comm.rank, (rows, 2), "float64"), op)
        np.testing.assert_array_equal(block, full[start : start + counts[comm.rank]])
    explicit = [0] * comm.size
    explicit[-1] = rows  # everything to the last rank
    block = comm.reduce_scatter(contribution(comm.rank, (rows, 2), "float64"), op, counts=explicit)
    np.testing.assert_array_equal(block, full if comm.rank == comm.size - 1 else full[:0])


def test_reduce_scatter_of_a_0d_array_is_an_error_on_every_rank(comm):
    """As in Horovod: a 0-d array has no axis 0 to split (it used to give rank 0 one element, the others none)."""
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            comm.reduce_scatter(np.array(float(comm.rank)), name="loss")
        assert not isinstance(info.value, CollectiveMismatchError)  # every rank's own error, none waits for another
        assert str(info.value).startswith(f"rank {comm.rank}: reduce_scatter of 'loss': a 0-d array (shape ())")
    bad = comm.size - 1  # a 0-d array on one rank only: the others are told which rank and why
    with pytest.raises(ValueError) as info:
        comm.reduce_scatter(np.array(1.0) if comm.rank == bad else np.ones(comm.size), name="loss")
    assert isinstance(info.value, CollectiveMismatchError) == (comm.rank != bad)
    assert f"rank {bad}: reduce_scatter of 'loss': a 0-d array" in str(info.value)
    np.testing.assert_array_equal(comm.reduce_scatter(np.ones(comm.size)), [comm.size])  # still in step
    unchecked = Communicator(comm.mpi_comm, Options(check_collectives=False, timeout=None))
    try:  # without the agreement every rank finds the error itself, before any MPI call
        with pytest.raises(ValueError, match=rf"^rank {comm.rank}: reduce_scatter of 'array': a 0-d array"):
            unchecked.reduce_scatter(np.array(1.0))
        np.testing.assert_array_equal(unchecked.reduce_scatter(np.ones((comm.size, 2))), [[comm.size] * 2])
    finally:
        unchecked.free()


def test_nonblocking_calls_of_one_name_are_matched_by_call_order(comm):
    """Unlike Horovod, a name may be in flight twice: names label calls, the order of the calls matches them."""
    total = comm.size * (comm.size + 1) / 2
    for _ in range(2):
        first = comm.iallreduce(np.full(3, comm.rank + 1.0), name="grad")
        second = comm.iallreduce(np.full(40000, 2.0 * (comm.rank + 1)), name="grad")  # beyond what the record carries
        third = comm.iallgather(np.full(2, comm.rank), name="grad")
        np.testing.assert_array_equal(third.wait(), np.repeat(np.arange(comm.size), 2))  # any order of waits
        np.testing.assert_array_equal(second.wait(), np.full(40000, 2 * total))
        np.testing.assert_array_equal(first.wait(), np.full(3, total))
        blocking = comm.allreduce(np.ones(2), name="grad")  # a blocking call of that name, handles done or not
        np.testing.assert_array_equal(blocking, [comm.size] * 2)


def test_split_counts_cover_and_balance(comm):
    for n in range(3 * comm.size + 2):
        counts = comm.split_counts(n)
        assert sum(counts) == n and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_barrier_and_local_topology(comm):
    for _ in range(2):
        comm.barrier()
    assert 0 <= comm.local_rank < comm.local_size <= comm.size and comm.num_nodes >= 1
    assert comm.mpi_comm != MPI.COMM_WORLD and comm.mpi_comm.size == comm.size


def test_invalid_arrays_raise_on_every_rank(comm):
    """The rank with bad input gets the specific error, the others a mismatch error naming it."""
    bad_rank = comm.size - 1
    cases = [
        (np.ones((4, 4))[:, ::2], "sum", TypeError, "C-contiguous"),
        (np.array(["a", "b"]), "sum", TypeError, "cannot send"),
        (np.arange(4), "mean", ValueError, "MEAN of dtype int64"),
        (np.ones(2, np.complex64), "max", ValueError, "MAX is not defined for complex"),
        ([1.0, 2.0], "sum", TypeError, "not an array"),
    ]
    for bad, op, local_error, text in cases:
        good = np.ones(4) if op == "mean" else np.ones((4, 2))
        mine = bad if comm.rank == bad_rank else good
        with pytest.raises((local_error, CollectiveMismatchError)) as info:
            comm.allreduce(mine, op)
        if comm.rank == bad_rank:
            assert isinstance(info.value, local_error) and text in str(info.value)
            assert f"rank {comm.rank}" in str(info.value)
        else:
            assert isinstance(info.value, CollectiveMismatchError)
            assert f"rank {bad_rank}: " in str(info.value) and "could not take part" in str(info.value)
    # the communicator is still in step afterwards
    np.testing.assert_array_equal(comm.allreduce(np.ones(1)), [comm.size])


def test_shape_mismatch_names_ranks_and_modifies_nothing(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    mine = np.full(3 + comm.rank % 2, float(comm.rank))
    before = mine.copy()
    with pytest.raises(CollectiveMismatchError) as info:
        comm.allreduce(mine, "sum", inplace=True)
    np.testing.assert_array_equal(mine, before)
    message = str(info.value)
    odd = [r for r in range(comm.size) if r % 2]
    even = [r for r in range(comm.size) if not r % 2]
    assert "float64[3]" in message and "float64[4]" in message
    assert f"{_ranks(even)}: #" in message and f"{_ranks(odd)}: #" in message, message
    assert set(info.value.records) == set(range(comm.size))
    with pytest.raises(CollectiveMismatchError, match="float32"):
        comm.broadcast(np.zeros(2, dtype=np.float32 if comm.rank == 0 else np.float64))
    with pytest.raises(CollectiveMismatchError, match="root"):
        comm.broadcast(np.zeros(2), root=comm.rank % 2)
    with pytest.raises(CollectiveMismatchError):  # allgather: trailing dims must agree
        comm.allgather(np.zeros((1, 2 + comm.rank % 2)))
    np.testing.assert_array_equal(comm.allreduce(np.ones(1)), [comm.size])


def _ranks(ranks: list) -> str:
    """How a message names a group of ranks (format_ranks, with its "rank"/"ranks" word)."""
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def test_checks_off_still_reduce_correctly():
    c = Communicator(MPI.COMM_WORLD, Options(check_collectives=False, timeout=None, piece_bytes=8192))
    for _ in range(2):
        np.testing.assert_array_equal(
            c.allreduce(contribution(c.rank, (5,), "int64")), expected("sum", c.size, (5,), "int64")
        )
        np.testing.assert_array_equal(
            c.allgather(np.full(c.rank + 1, c.rank)), np.repeat(np.arange(c.size), np.arange(1, c.size + 1))
        )
        c.barrier()
        for op in ("sum", "mean"):  # nonblocking, also in pieces
            a = contribution(c.rank, (3000,), "float64")
            handle = c.iallreduce(a, op)
            np.testing.assert_allclose(handle.wait(), expected(op, c.size, (3000,), "float64"))
    with pytest.raises(TypeError, match="C-contiguous"):  # the local check stays on
        c.allreduce(np.ones((2, 2))[:, 0])
    c.free()


def test_timeout_names_the_missing_rank():
    if MPI.COMM_WORLD.size < 2:
        pytest.skip("needs a rank that stays away")
    c = Communicator(MPI.COMM_WORLD, Options(timeout=1.0))
    for _ in range(2):  # with everyone present, the timeout path gives the right answers
        np.testing.assert_array_equal(c.allreduce(np.ones(3)), np.full(3, c.size))
        c.barrier()
    start = time.monotonic()
    if c.rank != 1:
        with warnings.catch_warnings(record=True) as caught, pytest.raises(CollectiveTimeoutError) as info:
            warnings.simplefilter("always")
            c.allreduce(np.ones(3))
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 1.9, elapsed  # the deadline plus its short grace: a doubled deadline fails
        assert info.value.missing_ranks == (1,)
        assert "rank 1 has not answered" in str(info.value)
        assert str(info.value).startswith(on_rank(c.rank, ""))  # the one rank prefix, error and warning alike
        assert any(
            str(w.message).startswith(on_rank(c.rank, "still waiting")) and "rank 1 has not answered" in str(w.message)
            for w in caught
        )
        with pytest.raises(Exception, match="unusable"):
            c.allreduce(np.ones(3))
    MPI.COMM_WORLD.Barrier()  # realign before the next test
    # c is unusable on purpose: it takes no part in the departures at exit, and this deadline error must not
    # set the test run's exit status (a rank that missed a deadline otherwise exits with status 1)
    agreement._live.remove(c.agreement)
    deadline._missed.clear()


def test_options_reject_unknown_and_malformed():
    with pytest.raises(ValueError, match="unknown mpidist option"):
        Options.resolve(env={}, timeuot=3)
    with pytest.raises(ValueError, match="MPIDIST_TIMEOUT"):
        Options.resolve(env={"MPIDIST_TIMEOUT": "soon"})
    env = {"MPIDIST_TIMEOUT": "2.5", "MPIDIST_CHECK": "off"}
    assert Options.resolve(env=env) == Options(timeout=2.5, check_collectives=False)


# -- byte payloads (allgather_bytes, broadcast_bytes), also with agreement checks off --------
@pytest.fixture(scope="module", params=["self", "world", "world-unchecked"])
def any_comm(request):
    base = MPI.COMM_SELF if request.param == "self" else MPI.COMM_WORLD
    unchecked = request.param == "world-unchecked"
    options = Options.resolve(env={}, check_collectives=not unchecked, timeout=None if unchecked else 600.0)
    c = Communicator(base, options)
    yield c
    c.free()


def payload(rank: int) -> bytes:
    """Rank r's payload: r bytes (rank 0 sends nothing), with values that depend on r."""
    return bytes((rank * 7 + i) % 256 for i in range(rank))


@pytest.mark.parametrize("repeat", [1, 2])
def test_allgather_bytes_returns_every_ranks_payload_in_rank_order(any_comm, repeat):
    got = any_comm.allgather_bytes(payload(any_comm.rank), name="test")
    assert got == [payload(r) for r in range(any_comm.size)]


def test_allgather_bytes_of_a_large_payload(any_comm):
    data = np.full(1 << 20, any_comm.rank, np.uint8).tobytes()
    got = any_comm.allgather_bytes(data)
    assert [len(g) for g in got] == [1 << 20] * any_comm.size
    assert all(set(g) == {r} for r, g in enumerate(got))


@pytest.mark.parametrize("repeat", [1, 2])
def test_broadcast_bytes_from_every_root(any_comm, repeat):
    for root in range(any_comm.size):
        message = f"from root {root} of {any_comm.size}".encode() * (root + 1)
        got = any_comm.broadcast_bytes(message if any_comm.rank == root else None, root, name="test")
        assert got == message


def test_broadcast_bytes_of_nothing(any_comm):
    assert any_comm.broadcast_bytes(b"" if any_comm.rank == 0 else b"ignored") == b""
    assert any_comm.broadcast_bytes(None) == b""


def test_allgather_into_out_and_an_out_that_does_not_fit_on_one_rank(comm):
    out = np.empty(2 * comm.size)
    assert comm.allgather(np.full(2, float(comm.rank)), out=out) is out
    np.testing.assert_array_equal(out, np.repeat(np.arange(comm.size, dtype=float), 2))
    bad = comm.size - 1
    wrong = np.empty(3) if comm.rank == bad else np.empty(2 * comm.size)
    with pytest.raises((ValueError, CollectiveMismatchError), match=f"rank {bad}"):
        comm.allgather(np.ones(2), out=wrong)
    np.testing.assert_array_equal(comm.allreduce(np.ones(1)), [comm.size])  # still usable
