"""alltoall, ialltoall, gather to a root, scatter from a root and ireduce_scatter, under mpiexec (1, 2 and 3 ranks).

Every expected value is derived from rank and size, so one test holds at any size; each check
runs twice (lazy initialisation). Each test runs on host arrays, and on device arrays where a GPU
or the CuPy stand-in is there (``-m gpu``, ``MPIDIST_TEST_DEVICE=standin``, with
``MPIDIST_CUDA_AWARE`` 1 or 0: device buffers handed to MPI, or staged through host memory).
Every rank makes the same calls in the same order, also where a call is expected to fail.

The tests named ``..._as_in_horovod`` restate, in our own words, what Horovod's collective tests
check of its ``alltoall`` and ``reducescatter_async``: the same inputs and expectations, through
``Communicator.alltoall(array, splits)`` and ``Communicator.ireduce_scatter(array, op)``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from arrays import DEVICES, assert_equal
from mpidist import CollectiveMismatchError, IntegerOverflowError, MPIStrategy, PerReplica
from mpidist._comm.communicator import Communicator
from mpidist._options import Options

pytestmark = pytest.mark.mpi

# Horovod's dtypes, and ours besides (bool, complex).
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool", "complex64"]
TAILS = {1: (), 2: (2,), 3: (2, 3)}  # the dimensions after axis 0, by number of dimensions


@pytest.fixture(scope="module", params=DEVICES)
def comm(request):
    """A communicator over every rank: host arrays, or device arrays (``gpu``) whose path follows MPIDIST_CUDA_AWARE."""
    c = Communicator(MPI.COMM_WORLD, Options.resolve(device=request.param))
    yield c
    c.free()


def rows(src: int, dest: int, count: int, tail: tuple, dtype: str) -> np.ndarray:
    """The ``count`` rows rank ``src`` sends rank ``dest``: row j filled with (4 * src + dest + j) % 11."""
    values = (4 * src + dest + np.arange(count)) % 11
    return np.broadcast_to(values.reshape((count,) + (1,) * len(tail)), (count,) + tail).astype(dtype)


def plan(count, rank: int, size: int, tail: tuple, dtype: str):
    """For ``count(src, dest)`` rows from each rank to each: this rank's input and splits, and what it receives."""
    send = np.concatenate([rows(rank, d, count(rank, d), tail, dtype) for d in range(size)])
    received = np.concatenate([rows(q, rank, count(q, rank), tail, dtype) for q in range(size)])
    return send, [count(rank, d) for d in range(size)], received, [count(q, rank) for q in range(size)]


def check_alltoall(comm, count, tail, dtype, *, even=False, nonblocking=False):
    """``comm.alltoall`` (or ``ialltoall``) twice with ``count(src, dest)`` rows each way: exact rows and counts."""
    xp = comm.backend.xp
    send, splits, want, want_splits = plan(count, comm.rank, comm.size, tail, dtype)
    for _ in range(2):
        mine = xp.asarray(send)
        call = comm.ialltoall if nonblocking else comm.alltoall
        result = call(mine, None if even else splits)
        received, received_splits = result.wait() if nonblocking else result
        assert type(received) is type(mine) and received.dtype == np.dtype(dtype)
        assert received.shape == want.shape
        assert_equal(received, want)
        assert type(received_splits) is np.ndarray and received_splits.dtype == np.int64
        assert received_splits.tolist() == want_splits
        assert_equal(mine, send)  # the input is left as it is


def still_in_step(comm):
    """Every rank can go on: the next collective agrees and is right."""
    received, splits = comm.alltoall(comm.backend.xp.asarray(np.full(comm.size, float(comm.rank))))
    assert_equal(received, np.arange(comm.size, dtype=float))
    assert splits.tolist() == [1] * comm.size


def raises_on_every_rank(comm, bad_rank, local_error, text, call):
    """``call()`` raises ``local_error`` (with ``text``) on ``bad_rank`` and a mismatch naming it everywhere else."""
    with pytest.raises((local_error, CollectiveMismatchError)) as info:
        call()
    if comm.rank == bad_rank:
        assert isinstance(info.value, local_error) and not isinstance(info.value, CollectiveMismatchError)
        assert str(info.value).startswith(f"rank {bad_rank}: ") and text in str(info.value), str(info.value)
    else:
        assert isinstance(info.value, CollectiveMismatchError)
        assert f"rank {bad_rank}: " in str(info.value) and "could not take part" in str(info.value)
        assert text in str(info.value)
    still_in_step(comm)


# -- the alltoall items of Horovod's tests ----------------------------------------------------------
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_with_splits_as_in_horovod(comm, dtype, dims):
    """Each rank r sends r + 1 rows to every rank: rank d receives r + 1 rows from each r, splits [1, 2, ...]."""
    check_alltoall(comm, lambda src, dest: src + 1, TAILS[dims], dtype)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_with_even_splits_as_in_horovod(comm, dtype, dims):
    """``splits=None``: every rank's rows cut into N equal blocks, one per rank (3 rows each here)."""
    check_alltoall(comm, lambda src, dest: 3, TAILS[dims], dtype, even=True)


def test_alltoall_of_empty_rows_as_in_horovod(comm):
    """N rows of no elements each (shape (N, 0)), split evenly: every rank receives N empty rows."""
    n = comm.size
    for _ in range(2):
        received, splits = comm.alltoall(comm.backend.xp.empty((n, 0), dtype=np.float32))
        assert received.shape == (n, 0) and received.dtype == np.float32 and received.size == 0
        assert splits.tolist() == [1] * n


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float16", "float64"])
def test_alltoall_where_one_rank_sends_nothing_as_in_horovod(comm, dtype, dims):
    """Rank 1 passes zero rows and zero splits; the others send r + 1 rows to every rank."""
    check_alltoall(comm, lambda src, dest: 0 if src == 1 else src + 1, TAILS[dims], dtype)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float16", "float64"])
def test_alltoall_where_one_rank_receives_nothing_as_in_horovod(comm, dtype, dims):
    """No rank sends rank 0 anything: rank 0 receives zero rows and zero splits."""
    check_alltoall(comm, lambda src, dest: 0 if dest == 0 else src + 1, TAILS[dims], dtype)


def test_alltoall_with_zero_splits_as_in_horovod(comm):
    """The first N // 2 ranks send one row to each of them; the others send and receive nothing."""
    active = comm.size // 2
    check_alltoall(comm, lambda src, dest: int(src < active and dest < active), (4,), "int32")
    xp, r = comm.backend.xp, comm.rank
    mine = xp.asarray(np.full((active if r < active else 0, 4), r, dtype=np.int32))
    received, splits = comm.alltoall(mine, [int(r < active and d < active) for d in range(comm.size)])
    assert received.shape == ((active, 4) if r < active else (0, 4))
    assert_equal(received, np.repeat(np.arange(active, dtype=np.int32), 4).reshape(-1, 4) if r < active else mine)
    assert splits.tolist() == [int(r < active and q < active) for q in range(comm.size)]


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_alltoall_in_process_sets_as_in_horovod(comm, dims):
    """Strategies over the even and over the odd ranks (``MPI.COMM_WORLD.Split``), at once: within each set,
    rank r sends r + 1 rows of its world rank to every member; between the sets' calls, one over every rank."""
    world, r = MPI.COMM_WORLD, MPI.COMM_WORLD.rank
    members = [q for q in range(world.size) if q % 2 == r % 2]
    sub = world.Split(r % 2, r)
    strategy = MPIStrategy(comm=sub, device="gpu" if comm.backend.is_gpu else "cpu")
    try:
        own = strategy.communicator
        xp, tail = own.backend.xp, TAILS[dims]
        for _ in range(2):
            mine = xp.asarray(np.full((len(members) * (r + 1),) + tail, r, dtype=np.float32))
            received, splits = own.alltoall(mine, [r + 1] * len(members))
            assert_equal(received, np.concatenate([np.full((q + 1,) + tail, q, np.float32) for q in members]))
            assert splits.tolist() == [q + 1 for q in members]
            still_in_step(comm)  # a collective over every rank between the sets' calls matches no set's
    finally:
        strategy.free()
        sub.Free()


def test_alltoall_of_dtypes_that_differ_as_in_horovod(comm):
    """Odd ranks pass int32, even ranks float32: a mismatch on every rank, naming both dtypes."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    mine = comm.backend.xp.ones(comm.size, dtype=np.int32 if comm.rank % 2 else np.float32)
    with pytest.raises(CollectiveMismatchError) as info:
        comm.alltoall(mine)
    assert "int32" in str(info.value) and "float32" in str(info.value)
    still_in_step(comm)


def test_alltoall_of_rows_that_cannot_split_evenly_as_in_horovod(comm):
    """N + 1 rows and no splits: a ValueError on every rank (each finds it in its own arguments)."""
    if comm.size == 1:
        pytest.skip("every length splits evenly over one rank")
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            comm.alltoall(comm.backend.xp.ones(comm.size + 1))
        assert not isinstance(info.value, CollectiveMismatchError)
        assert str(info.value).startswith(f"rank {comm.rank}: alltoall of 'array': {comm.size + 1} rows cannot")
    still_in_step(comm)


def test_alltoall_of_splits_beyond_the_rows_as_in_horovod(comm):
    """N - 1 rows and one row for every rank: a ValueError on every rank, naming the splits and the rows."""
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"^rank {comm.rank}: alltoall of 'array': splits \[1(, 1)*\] must be"):
            comm.alltoall(comm.backend.xp.ones(comm.size - 1), np.ones(comm.size, dtype=np.int32))
    still_in_step(comm)


def test_alltoall_of_float_splits_as_in_horovod(comm):
    """Splits of dtype float32 (Horovod asks for integers): a ValueError on every rank."""
    for _ in range(2):
        with pytest.raises(
            ValueError, match=rf"^rank {comm.rank}: .*splits must be a 1-d array of integers, got float32"
        ):
            comm.alltoall(comm.backend.xp.ones(comm.size), np.ones(comm.size, dtype=np.float32))
    still_in_step(comm)


def test_alltoall_of_trailing_dimensions_that_differ_as_in_horovod(comm):
    """Shapes (2N, 10 (r + 1), 2N): the dimensions after axis 0 differ, a mismatch on every rank."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    mine = comm.backend.xp.ones((2 * comm.size, 10 * (comm.rank + 1), 2 * comm.size))
    with pytest.raises(CollectiveMismatchError, match="ranks disagree on collective"):
        comm.alltoall(mine)
    still_in_step(comm)


# -- alltoall: our own cases ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, text",
    [
        ("short", "must be"),  # one split too few
        ("negative", "non-negative integers adding up"),
        ("sum", "adding up to the"),
        ("floats", "splits must be integers, got 1.0 (float)"),
        ("bools", "splits must be integers, got True (bool)"),
        ("2-d", "1-d array of integers"),
        ("number", "splits must be a sequence of integers, got"),
        ("0-d array", "a 0-d array (shape ()) has no axis 0"),
    ],
)
def test_bad_splits_on_one_rank_raise_on_every_rank(comm, bad, text):
    n, r = comm.size, comm.rank
    last = n - 1
    good = [1] * n
    wrong = {
        "short": [1] * (n - 1),
        "negative": [-1, *([1] * (n - 2)), 2] if n > 1 else [-1],
        "sum": [2] * n,
        "floats": [1.0] * n,
        "bools": [True] * n,
        "2-d": np.ones((n, 1), dtype=np.int64),
        "number": n,
        "0-d array": good,
    }[bad]
    array = comm.backend.xp.ones(n) if bad != "0-d array" or r != last else comm.backend.xp.ones(())
    raises_on_every_rank(comm, last, ValueError, text, lambda: comm.alltoall(array, wrong if r == last else good))


def test_splits_of_other_kinds(comm):
    """Splits as a tuple of NumPy integers, an int32 array, an unsigned one, or an array of the comm's module."""
    n, xp = comm.size, comm.backend.xp
    kinds = [tuple(np.int16(2) for _ in range(n)), np.full(n, 2, np.int32), np.full(n, 2, np.uint64), xp.full(n, 2)]
    for splits in kinds:
        received, counts = comm.alltoall(xp.asarray(np.repeat(np.arange(n), 2)), splits)
        assert_equal(received, np.full(2 * n, comm.rank))
        assert counts.tolist() == [2] * n


def test_even_splits_on_some_ranks_only_are_a_mismatch(comm):
    """``splits=None`` means the same shape everywhere: ranks that pass splits while others do not disagree."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    n = comm.size
    with pytest.raises(CollectiveMismatchError, match="split evenly") as info:
        comm.alltoall(comm.backend.xp.ones(n), None if comm.rank == 0 else [1] * n)
    assert "with splits" in str(info.value)
    still_in_step(comm)


def data_calls(comm, monkeypatch) -> list[str]:
    """The MPI collectives the communicator's transport makes from now on (its own calls, not the agreement's)."""
    seen: list[str] = []
    transport = comm._transport
    run, start = transport.run, transport.start
    inside_run = []

    def running(what, name, *args, **kw):
        seen.append(name)
        inside_run.append(name)  # run() may start the nonblocking form: one call
        try:
            return run(what, name, *args, **kw)
        finally:
            inside_run.pop()

    def starting(name, *args, **kw):
        if not inside_run:
            seen.append(name)
        return start(name, *args, **kw)

    monkeypatch.setattr(transport, "run", running)
    monkeypatch.setattr(transport, "start", starting)
    return seen


def random_bits(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    """An array whose elements are random bit patterns: NaNs with payloads (signalling ones too), -0.0, infinities,
    integers beyond 2**53; bool as 0 and 1."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.integers(0, 256, size, dtype=np.uint8).tobytes(), dtype=dtype).reshape(shape).copy()


@pytest.mark.parametrize("nonblocking", [False, True])
@pytest.mark.parametrize("dtype", ["int64", "uint64", "float64", "float32", "complex128", "float16", "int8", "bool"])
def test_small_alltoalls_move_every_bit_in_the_agreement_record(comm, dtype, nonblocking, monkeypatch):
    """Rows of a few words per rank travel inside the agreement's record, as their bits: every bit pattern arrives
    as it was sent (NaN payloads, signalling NaNs, -0.0, int64 beyond 2**53), and no data call follows. Larger rows
    take MPI_Alltoall and arrive the same; splits of each rank's own bring their counts in the record too."""
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    words = np.dtype(dtype).itemsize // min(np.dtype(dtype).itemsize, 4)  # record slots per element
    for per_rank in (1, 40):
        rows = [random_bits(dtype, (per_rank, 2), 1000 * q + per_rank) for q in range(n)]  # rank q's input
        want = np.concatenate([rows[q][per_rank * r // n : per_rank * (r + 1) // n] for q in range(n)])
        carried = not comm.backend.is_gpu and n * n * (per_rank // n) * 2 * words <= 32 and per_rank >= n
        for splits in (
            (None, [per_rank // n] * n)
            if per_rank % n == 0
            else ([per_rank // n + (d < per_rank % n) for d in range(n)],)
        ):
            if splits is not None:
                want = np.concatenate(
                    [rows[q][sum(splits[:r]) : sum(splits[: r + 1])] for q in range(n)]
                )  # every rank passes the same splits here
            seen = data_calls(comm, monkeypatch)
            mine = xp.asarray(rows[r])
            received, counts = comm.ialltoall(mine, splits).wait() if nonblocking else comm.alltoall(mine, splits)
            assert received.dtype == np.dtype(dtype) and received.shape == want.shape
            assert np.asarray(received.get() if comm.backend.is_gpu else received).tobytes() == want.tobytes()
            assert counts.tolist() == ([per_rank // n] * n if splits is None else [splits[r]] * n)
            if splits is None:
                assert seen == ([] if carried else ["Alltoall"]), seen
            else:
                assert seen == (["Alltoallv"] if n * n <= 32 else ["Alltoall", "Alltoallv"]), seen
            monkeypatch.undo()


@pytest.mark.parametrize("even", [False, True])
def test_ialltoall_handles_complete_in_any_order(comm, even):
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    for _ in range(2):
        count = 2 if even else r + 1
        first = comm.ialltoall(xp.asarray(np.repeat(np.arange(n), count)), None if even else [count] * n, name="a")
        second = comm.ialltoall(xp.asarray(np.full((n, 3), float(r))), name="b")
        third = comm.ireduce_scatter(xp.asarray(np.ones((n, 2))), "sum")
        assert_equal(third.wait(), np.full((1, 2), n))
        received, splits = second.wait()
        assert_equal(received, np.repeat(np.arange(n, dtype=float), 3).reshape(n, 3))
        received, splits = first.wait()
        assert_equal(received, np.full(sum(2 if even else q + 1 for q in range(n)), r))
        assert splits.tolist() == [2 if even else q + 1 for q in range(n)]
        assert first.test() and first.wait()[0] is received  # waiting again returns the same result
    check_alltoall(comm, lambda src, dest: (src + dest) % 3, (2,), "float32", nonblocking=True)


@pytest.mark.parametrize("call", ["ialltoall", "ireduce_scatter"])
def test_a_nonblocking_call_returns_before_a_late_rank_arrives(comm, call):
    """A rank that starts ialltoall or ireduce_scatter does not wait there for the others (the last one is late)."""
    if comm.size == 1:
        pytest.skip("needs a rank to be late")
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    late = 1.0
    mine = xp.asarray(np.repeat(np.arange(n), r + 1).astype(np.float64))
    full = xp.asarray(np.arange(4.0 * n))
    comm.barrier()
    if r == n - 1:
        time.sleep(late)
    began = time.monotonic()
    handle = comm.ialltoall(mine, [r + 1] * n) if call == "ialltoall" else comm.ireduce_scatter(full, "sum", [4] * n)
    returned = time.monotonic() - began
    if r != n - 1:
        assert returned < late / 2, f"{call} took {returned:.2f} s: it waited for the late rank"
    if call == "ialltoall":
        received, splits = handle.wait()
        assert_equal(received, np.full(n * (n + 1) // 2, float(r)))
        assert splits.tolist() == [q + 1 for q in range(n)]
    else:
        assert_equal(handle.wait(), np.arange(4.0 * r, 4.0 * r + 4) * n)


# -- ireduce_scatter --------------------------------------------------------------------------------
def test_ireduce_scatter_of_many_handles_as_in_horovod(comm):
    """Handles for int32, int64, float16, float32, float64 and 1-3 dimensions of (4N, ...) started together, then
    waited: each rank gets its 4 rows of the sum (the same random integers on every rank, times N: exact)."""
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    rng = np.random.default_rng(1234)  # the same numbers on every rank
    started = []
    for dtype in ["int32", "int64", "float16", "float32", "float64"]:
        for dims in (1, 2, 3):
            full = rng.integers(-100, 100, size=(4 * n,) * dims).astype(dtype)
            want = full[4 * r : 4 * r + 4] * np.dtype(dtype).type(n)
            started.append((want, comm.ireduce_scatter(xp.asarray(full))))
    for want, handle in started:
        result = handle.wait()
        assert result.shape == want.shape and result.dtype == want.dtype
        assert_equal(result, want)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_ireduce_scatter_matches_reduce_scatter(comm, op):
    n, xp = comm.size, comm.backend.xp
    rows_ = 2 * n + 1
    mine = xp.asarray((np.arange(rows_ * 2).reshape(rows_, 2) + comm.rank).astype(np.float64))
    for counts in (None, [0] * (n - 1) + [rows_]):
        for _ in range(2):
            assert_equal(comm.ireduce_scatter(mine, op, counts).wait(), comm.reduce_scatter(mine, op, counts))


def test_ireduce_scatter_of_a_0d_array_and_of_bad_counts_raise_on_every_rank(comm):
    xp, last = comm.backend.xp, comm.size - 1
    raises_on_every_rank(
        comm,
        last,
        ValueError,
        "a 0-d array (shape ()) has no axis 0",
        lambda: comm.ireduce_scatter(xp.ones(()) if comm.rank == last else xp.ones(comm.size)).wait(),
    )
    counts = [comm.size + 1] if comm.rank == last else [1] * comm.size
    raises_on_every_rank(
        comm, last, ValueError, "counts", lambda: comm.ireduce_scatter(xp.ones(comm.size), counts=counts).wait()
    )


def test_ireduce_scatter_refuses_an_overflow_on_every_rank():
    """With check_overflow the sum is reduced whole: an int8 sum beyond 127 raises at wait() on every rank."""
    checked = Communicator(MPI.COMM_WORLD, Options.resolve(env={}, check_overflow=True))
    try:
        n, r = checked.size, checked.rank
        block = checked.ireduce_scatter(np.arange(n, dtype=np.int8).reshape(n, 1) + r).wait()
        assert block.dtype == np.int8 and block.tolist() == [[n * r + n * (n - 1) // 2]]
        handle = checked.ireduce_scatter(np.full(n, 100, dtype=np.int8))
        if n == 1:
            assert handle.wait().tolist() == [100]
        else:
            with pytest.raises(IntegerOverflowError, match="does not fit dtype int8"):
                handle.wait()
            with pytest.raises(IntegerOverflowError):  # and again at every later wait()
                handle.wait()
        assert checked.reduce_scatter(np.ones(n, dtype=np.int8)).tolist() == [n]  # still in step
    finally:
        checked.free()


# -- gather and scatter ---------------------------------------------------------------------------------
def contribution(rank: int, shape, dtype: str) -> np.ndarray:
    """Rank r's array: (r + 1) * (1, 2, 3, 4, 1, 2, ...) in ``shape``."""
    n = int(np.prod(shape, dtype=np.int64))
    return ((rank + 1) * (np.arange(n) % 4 + 1)).reshape(shape).astype(dtype)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "float16", "float64", "complex128"])
def test_gather_to_every_root(comm, dtype):
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    for _ in range(2):
        for root in range(n):
            mine = xp.asarray(contribution(r, (r, 2), dtype))  # rank 0 sends no rows
            got = comm.gather(mine, root=root)
            if r == root:
                assert type(got) is type(mine) and got.dtype == np.dtype(dtype)
                assert_equal(got, np.concatenate([contribution(q, (q, 2), dtype) for q in range(n)]))
            else:
                assert got is None
            scalars = comm.gather(xp.asarray(np.array(10 * r, dtype=dtype)), root)  # a 0-d array: one element
            if r == root:
                assert_equal(scalars, (np.arange(n) * 10).astype(dtype))


def test_gather_errors_raise_on_every_rank(comm):
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    raises_on_every_rank(
        comm, n - 1, ValueError, f"root {n} is not a rank", lambda: comm.gather(xp.ones(2), n if r == n - 1 else 0)
    )
    if n > 1:
        with pytest.raises(CollectiveMismatchError, match=r"gather\(root=0\)"):  # the dimensions after axis 0 differ
            comm.gather(xp.ones((1, 2 + r % 2)))
        with pytest.raises(CollectiveMismatchError, match=r"gather\(root=1\)"):  # ranks name different roots
            comm.gather(xp.ones(2), root=r % 2)
        still_in_step(comm)


SHAPES = [(), (3,), (0, 2), (2, 3)]  # rank q receives an array of shape SHAPES[q % 4]


@pytest.mark.parametrize("dtype", ["bool", "int8", "int64", "float16", "float32", "complex64"])
def test_scatter_from_every_root(comm, dtype):
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    for _ in range(2):
        for root in range(n):
            arrays = [xp.asarray(contribution(q, SHAPES[q % 4], dtype)) for q in range(n)] if r == root else "ignored"
            got = comm.scatter(arrays, root=root)
            assert type(got) is type(xp.empty(0)) and got.dtype == np.dtype(dtype) and got.shape == SHAPES[r % 4]
            assert_equal(got, contribution(r, SHAPES[r % 4], dtype))
    host = comm.scatter([np.full(2, q) for q in range(n)] if r == 0 else None)  # host arrays into the module's
    assert type(host) is type(xp.empty(0))
    assert_equal(host, np.full(2, r))


@pytest.mark.parametrize(
    "bad, error, text",
    [
        ("too many", ValueError, "a list of"),
        ("none", ValueError, "got a NoneType"),
        ("dtypes", ValueError, "one dtype and array module"),
        ("strided", TypeError, "C-contiguous"),
        ("root", ValueError, "is not a rank"),
    ],
)
def test_scatter_errors_of_the_root_raise_on_every_rank(comm, bad, error, text):
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    if bad == "dtypes" and n == 1:
        pytest.skip("one array has one dtype")
    good = [xp.ones(2) for _ in range(n)]
    wrong = {
        "too many": good + [xp.ones(2)],
        "none": None,
        "dtypes": [xp.ones(2, dtype=np.float32 if q == n - 1 else np.float64) for q in range(n)],
        "strided": [xp.ones((2, 4))[:, ::2] for _ in range(n)],
        "root": good,
    }[bad]
    root = n if bad == "root" and r == 0 else 0
    raises_on_every_rank(comm, 0, error, text, lambda: comm.scatter(wrong if r == 0 else None, root))


def test_scatter_of_roots_that_differ_is_a_mismatch(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    xp, n = comm.backend.xp, comm.size
    with pytest.raises(CollectiveMismatchError, match=r"scatter\(root=1\)"):
        comm.scatter([xp.ones(1)] * n, root=comm.rank % 2)
    still_in_step(comm)


def test_bfloat16_moves_bit_for_bit(comm):
    """bfloat16 (ml_dtypes) rows travel as their 16 bits through alltoall, ialltoall, gather and scatter."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    if comm.backend.is_gpu:
        pytest.skip("host arrays: bfloat16 on a GPU depends on the CuPy version")
    n, r = comm.size, comm.rank
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def of(rank: int) -> np.ndarray:  # values bfloat16 rounds: a copy through any other dtype would show
        return (np.arange(2 * n) / 3 + rank).astype(bf16)

    for _ in range(2):
        received, _splits = comm.alltoall(of(r))
        want = np.concatenate([of(q)[2 * r : 2 * r + 2] for q in range(n)])
        assert received.dtype == bf16 and received.view(np.uint16).tolist() == want.view(np.uint16).tolist()
        received, _splits = comm.ialltoall(of(r), [2] * n).wait()
        assert received.view(np.uint16).tolist() == want.view(np.uint16).tolist()
        gathered = comm.gather(of(r), root=n - 1)
        if r == n - 1:
            assert gathered.dtype == bf16
            assert (
                gathered.view(np.uint16).tolist() == np.concatenate([of(q) for q in range(n)]).view(np.uint16).tolist()
            )
        mine = comm.scatter([of(q)[: q + 1] for q in range(n)] if r == 0 else None)
        assert mine.dtype == bf16 and mine.view(np.uint16).tolist() == of(r)[: r + 1].view(np.uint16).tolist()


# -- without the agreement, on a device, and at the strategy ----------------------------------------
def test_every_call_without_checks():
    """check_collectives off (no agreement) and no deadline: the same results; local errors stay local."""
    c = Communicator(MPI.COMM_WORLD, Options.resolve(env={}, check_collectives=False, timeout=None))
    try:
        n, r = c.size, c.rank
        for _ in range(2):
            check_alltoall(c, lambda src, dest: src + dest, (2,), "int64")
            check_alltoall(c, lambda src, dest: 2, (), "float32", even=True, nonblocking=True)
            check_alltoall(c, lambda src, dest: dest, (), "float64", nonblocking=True)
            gathered = c.gather(np.full(r + 1, r), root=n - 1)
            assert (gathered is None) == (r != n - 1)
            assert c.scatter([np.full(q, q) for q in range(n)] if r == 0 else None).tolist() == [r] * r
            assert_equal(c.ireduce_scatter(np.ones((n, 2))).wait(), np.full((1, 2), n))
        with pytest.raises(ValueError, match=rf"^rank {r}: alltoall of 'array': splits"):
            c.alltoall(np.ones(n), [n + 1])
    finally:
        c.free()


def test_device_copies_of_each_call(comm, device_ledger):
    """Staged: each call copies its input and its output buffer to the host, and the output back (the root of a
    scatter, which packs the arrays on the device, likewise); CUDA-aware: no copy, MPI reads device buffers."""
    if not comm.backend.is_gpu:
        pytest.skip("device arrays only")
    n, r, xp = comm.size, comm.rank, comm.backend.xp
    calls = [
        (lambda: comm.alltoall(xp.full((n, 2), 1.0)), (1, 2)),
        (lambda: comm.alltoall(xp.full(2 * n, 1.0), [2] * n), (1, 2)),
        (lambda: comm.ialltoall(xp.full(2 * n, 1.0), [2] * n).wait(), (1, 2)),
        (lambda: comm.ireduce_scatter(xp.full((n, 2), 1.0)).wait(), (1, 2)),
        (lambda: comm.gather(xp.full(3, 1.0)), (1, 2) if r == 0 else (0, 1)),
        (lambda: comm.scatter([xp.full(3, 1.0)] * n if r == 0 else None), (1, 2) if r == 0 else (1, 1)),
    ]
    for call, (h2d, d2h) in calls:
        xp.cuda.get_current_stream().synchronize()
        device_ledger.reset()
        call()
        assert device_ledger.copies() == ((0, 0) if comm.cuda_aware else (h2d, d2h)), device_ledger.snapshot()
        assert device_ledger.implicit == []
        assert (device_ledger.mpi_reads > 0) == comm.cuda_aware, device_ledger.snapshot()


def test_alltoall_on_the_strategy_in_both_contexts(comm):
    """``strategy.extended.alltoall``: this replica's component of a PerReplica (cross-replica context), or the
    replica's own array (inside ``run``, where the result comes back as a PerReplica)."""
    strategy = MPIStrategy(device="gpu" if comm.backend.is_gpu else "cpu")
    try:
        n, r, xp = strategy.num_replicas_in_sync, strategy.rank, strategy.backend.xp
        value = PerReplica({r: xp.asarray(np.repeat(np.arange(n), r + 1).astype(np.float32))})
        with strategy.scope():
            received, splits = strategy.extended.alltoall(value, [r + 1] * n)
            assert_equal(received, np.full(n * (n + 1) // 2, r, np.float32))
            assert splits.tolist() == [q + 1 for q in range(n)]
            rows_of_rank = PerReplica({r: xp.asarray(np.full((n, 2), float(r)))})
            result = strategy.run(lambda x: strategy.extended.alltoall(x)[0], args=(rows_of_rank,))
        assert isinstance(result, PerReplica)
        assert_equal(result.get(r), np.repeat(np.arange(n, dtype=float), 2).reshape(n, 2))
    finally:
        strategy.free()
