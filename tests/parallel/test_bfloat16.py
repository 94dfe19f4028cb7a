"""bfloat16 (ml_dtypes) and float16 in every collective, under mpiexec at 1, 2 and 3 ranks.

MPI has no bfloat16, and its float16 reductions (where a library has them) round to 16 bits at
every combine of two ranks' values. mpidist reduces both through float32 and rounds once; small
sums carried by the agreement record are summed in float64 and rounded once (docs/guide.md,
"bfloat16 and float16"). The inputs here are three values per element (those of ranks 0, 1 and
2; further ranks add zeros) whose float32 sums are exact, and for which rounding after every
combine gives another result than rounding the exact sum once, in every order of the three: a
16-bit reduction fails these tests at 3 ranks, whatever order the MPI library takes. Results
are compared bit for bit.

Device arrays run on the CuPy stand-in (``-m gpu``, ``MPIDIST_TEST_DEVICE=standin``), whose arrays
hold bfloat16 as CuPy 14's do. Every rank makes the same calls in the same order.
"""

from __future__ import annotations

import ctypes
import itertools
from functools import cache
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import host
from foreign import DLPackOnly
from mpidist import CollectiveMismatchError
from mpidist._comm.communicator import Communicator
from mpidist._options import Options

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (pip install 'mpidist[bfloat16]')")

pytestmark = pytest.mark.mpi

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HALVES = ["bfloat16", "float16"]
PIECE = 1024  # piece_bytes of the communicators here: a large array is many float32 pieces
SMALL, LARGE = 7, 3000  # elements: carried by the agreement record; reduced in pieces through float32


def dtype_of(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def rounded(values: Any, dtype: np.dtype) -> np.ndarray:
    """``values`` (float64) rounded once to ``dtype``, back as float64."""
    return np.asarray(values, dtype=np.float64).astype(dtype).astype(np.float64)


@cache
def triples(name: str) -> np.ndarray:
    """Ranks 0-2's values of 64 elements (float64 holding values of the dtype), shape (64, 3).

    Each triple's sum is exact in float32 (8 or 11 significant bits over at most 8 binades), and
    rounding to the dtype after each of the two additions gives another result than rounding the
    sum once, in all six orders. Drawn from a fixed seed: the same on every rank.
    """
    dtype = dtype_of(name)
    rng = np.random.default_rng(2024)
    found: list[np.ndarray] = []
    while len(found) < 64:
        values = rounded(rng.choice([-1.0, 1.0], 3) * rng.uniform(0.5, 4.0, 3) * 2.0 ** rng.integers(-2, 3, 3), dtype)
        once = rounded(values.sum(), dtype)
        hops = {float(rounded(rounded(a + b, dtype) + c, dtype)) for a, b, c in itertools.permutations(values)}
        if float(once) not in hops:
            found.append(values)
    return np.array(found)


def contribution(rank: int, n: int, name: str) -> np.ndarray:
    """Rank ``rank``'s ``n`` values (of dtype ``name``): its column of the triples, tiled; zeros past rank 2."""
    column = triples(name)[:, rank] if rank < 3 else np.zeros(64)
    return np.resize(column, n).astype(dtype_of(name))


def exact_sum(size: int, n: int, name: str) -> np.ndarray:
    """The exact sums over ``size`` ranks (float64, exact for these values)."""
    return sum(contribution(r, n, name).astype(np.float64) for r in range(size))


def expected(op: str, size: int, n: int, name: str, carried: bool = False) -> np.ndarray:
    """What mpidist gives: the float32 sum (float64 when ``carried``) rounded once; MEAN divides it first, in that
    type."""
    total = exact_sum(size, n, name)
    if op == "sum":
        return total.astype(dtype_of(name))
    if op == "mean":
        mean = total / size if carried else total.astype(np.float32) / np.float32(size)
        return mean.astype(dtype_of(name))
    stack = np.stack([contribution(r, n, name) for r in range(size)])
    return (stack.min(axis=0) if op == "min" else stack.max(axis=0)).astype(dtype_of(name))


def assert_bits(actual: Any, wanted: np.ndarray) -> None:
    """Bit for bit (16-bit floats compared as their bit patterns), and of the same dtype."""
    got = host(actual)
    assert got.dtype == wanted.dtype, (got.dtype, wanted.dtype)
    np.testing.assert_array_equal(got.view(np.uint16), wanted.view(np.uint16), err_msg=f"{got} != {wanted}")


CONFIGS = {
    "default": {},
    "unchecked": {"check_collectives": False, "timeout": None},  # no agreement: the latency path
    "hierarchical": {"hierarchical": True, "node_size": 2},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def comm(request):
    c = Communicator(MPI.COMM_WORLD, Options.resolve(env={}, piece_bytes=PIECE, **CONFIGS[request.param]))
    yield c
    c.free()


@pytest.fixture(scope="module")
def plain():
    c = Communicator(MPI.COMM_WORLD, Options.resolve(env={}, piece_bytes=PIECE))
    yield c
    c.free()


# -- reductions -----------------------------------------------------------------------------------
def test_the_inputs_defeat_rounding_at_every_hop():
    """At 3 ranks, a 16-bit reduction in any order gives other results than these tests expect."""
    for name in HALVES:
        dtype = dtype_of(name)
        a, b, c = (contribution(r, 64, name).astype(np.float64) for r in range(3))
        once = expected("sum", 3, 64, name)
        for x, y, z in itertools.permutations((a, b, c)):
            hop = (rounded(x + y, dtype) + z).astype(dtype)
            assert (hop.view(np.uint16) != once.view(np.uint16)).all()


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("form", ["new", "inplace", "out"])
def test_allreduce_sum_is_rounded_once(comm, name, n, form):
    for _ in range(2):
        x = contribution(comm.rank, n, name)
        out = np.empty_like(x) if form == "out" else None
        result = comm.allreduce(x, "sum", inplace=form == "inplace", out=out)
        assert_bits(result, expected("sum", comm.size, n, name))
        assert result is (x if form == "inplace" else out if form == "out" else result)


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_allreduce_mean(comm, name, n):
    carried = n == SMALL and comm.agreement.enabled
    for _ in range(2):
        result = comm.allreduce(contribution(comm.rank, n, name), "mean")
        assert_bits(result, expected("mean", comm.size, n, name, carried=carried))


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_are_exact(plain, name, op):
    for n in (SMALL, LARGE):
        assert_bits(plain.allreduce(contribution(plain.rank, n, name), op), expected(op, plain.size, n, name))


@pytest.mark.parametrize("name", HALVES)
def test_the_record_sums_in_float64_the_wire_in_float32(plain, name):
    """Which wider sum is rounded: float64 in the agreement record (up to 32 elements on the host), float32 on
    the wire. Ranks 0-2 add x, half an ulp of x and x * 2**-30 (x = 1, and 1024 for float16, whose range ends
    at 2**-24): the float64 sum lies above the midpoint between x and the next 16-bit float, the float32 sum on
    it (the third value is lost in any order), which rounds to even: x."""
    dtype = dtype_of(name)
    x = 1024.0 if name == "float16" else 1.0
    half_ulp = x * 2.0 ** -(np.finfo(dtype).nmant + 1)
    values = [x, half_ulp, x * 2.0**-30][: plain.size]
    mine = values[plain.rank] if plain.rank < 3 else 0.0
    small, large = (plain.allreduce(np.full(n, mine, dtype=dtype)) for n in (SMALL, LARGE))
    float32_sum = np.float32(0)
    for v in values:
        float32_sum += np.float32(v)
    assert_bits(small, np.full(SMALL, sum(values)).astype(dtype))
    assert_bits(large, np.full(LARGE, float32_sum).astype(dtype))
    if plain.size == 3:
        assert host(small)[0] == x + 2 * half_ulp and host(large)[0] == x


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_nonblocking_allreduce(comm, name, n):
    carried = n == SMALL and comm.agreement.enabled
    for _ in range(2):
        sums = comm.iallreduce(contribution(comm.rank, n, name), "sum")
        means = comm.iallreduce(contribution(comm.rank, n, name), "mean")
        assert_bits(means.wait(), expected("mean", comm.size, n, name, carried=carried))
        assert_bits(sums.wait(), expected("sum", comm.size, n, name))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_fused_allreduce_many(comm, op):
    """A mixed list: small and large arrays of both 16-bit floats, fused into buckets, beside float32."""
    sizes = [("bfloat16", SMALL), ("bfloat16", LARGE), ("float16", SMALL), ("bfloat16", 40), ("float16", LARGE)]
    for _ in range(2):
        arrays = [contribution(comm.rank, n, name) for name, n in sizes] + [np.full(5, comm.rank + 1.0, np.float32)]
        outs = [np.empty_like(a) for a in arrays]
        for results in (
            comm.allreduce_many(arrays, op),
            comm.allreduce_many(arrays, op, out=outs),
            comm.iallreduce_many(arrays, op).wait(),
        ):
            for (name, n), result in zip(sizes, results):
                assert_bits(result, expected(op, comm.size, n, name))
            total = comm.size * (comm.size + 1) / 2
            np.testing.assert_array_equal(results[-1], np.full(5, total if op == "sum" else total / comm.size))


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter(comm, name, op):
    rows = 2 * comm.size + 1  # uneven: the first rank gets one row more
    for _ in range(2):
        x = contribution(comm.rank, rows * 3, name).reshape(rows, 3)
        block = comm.reduce_scatter(x, op)
        whole = expected(op, comm.size, rows * 3, name).reshape(rows, 3)
        start = sum(comm.split_counts(rows)[: comm.rank])
        assert_bits(block, whole[start : start + comm.split_counts(rows)[comm.rank]])


def test_mirrored_variable_updates():
    """assign_add in replica context: the SUM of every rank's bfloat16 update, rounded once, added on every rank."""
    strategy = md.MPIStrategy(piece_bytes=PIECE)
    try:
        with strategy.scope():
            for n in (SMALL, LARGE):
                v = md.Variable(np.ones(n, dtype=BFLOAT16), aggregation="sum")
                assert v.dtype == BFLOAT16
                mine = contribution(strategy.rank, n, "bfloat16")
                strategy.run(md.MirroredVariable.assign_add, args=(v, mine))
                update = expected("sum", strategy.num_replicas_in_sync, n, "bfloat16")
                assert_bits(v.numpy(), np.ones(n, dtype=BFLOAT16) + update)
                strategy.run(md.MirroredVariable.assign, args=(v, mine))
                assert_bits(v.numpy(), update)
    finally:
        strategy.free()


# -- moving 16-bit floats -------------------------------------------------------------------------
def bit_patterns(rank: int, n: int, name: str) -> np.ndarray:
    """16-bit floats of every kind (NaNs with payloads, infinities, -0, subnormals), as their bits differ by rank."""
    bits = (np.arange(n, dtype=np.uint32) * 2654435761 + rank * 40503) % 65536
    return bits.astype(np.uint16).view(dtype_of(name))


@pytest.mark.parametrize("name", HALVES)
def test_broadcast_and_allgather_move_the_bits(plain, name):
    for _ in range(2):
        x = bit_patterns(plain.rank, 999, name)
        assert_bits(plain.broadcast(x, root=plain.size - 1), bit_patterns(plain.size - 1, 999, name))
        gathered = plain.allgather(bit_patterns(plain.rank, plain.rank + 1, name))
        assert_bits(gathered, np.concatenate([bit_patterns(r, r + 1, name) for r in range(plain.size)]))
        handle = plain.iallgather(bit_patterns(plain.rank, 4, name))
        assert_bits(handle.wait(), np.concatenate([bit_patterns(r, 4, name) for r in range(plain.size)]))


@pytest.mark.parametrize("name", HALVES)
def test_alltoall_gather_and_scatter_move_the_bits(plain, name):
    n, r = plain.size, plain.rank
    for _ in range(2):
        received, splits = plain.alltoall(bit_patterns(r, (r + 1) * n, name), [r + 1] * n)
        sent = [bit_patterns(q, (q + 1) * n, name)[r * (q + 1) : (r + 1) * (q + 1)] for q in range(n)]
        assert_bits(received, np.concatenate(sent))
        assert list(splits) == [q + 1 for q in range(n)]
        gathered = plain.gather(bit_patterns(r, r + 2, name), root=n - 1)
        if r == n - 1:
            assert_bits(gathered, np.concatenate([bit_patterns(q, q + 2, name) for q in range(n)]))
        else:
            assert gathered is None
        arrays = [bit_patterns(q, q + 3, name) for q in range(n)] if r == 0 else None
        assert_bits(plain.scatter(arrays, root=0), bit_patterns(r, r + 3, name))


# -- errors ---------------------------------------------------------------------------------------
def test_bfloat16_on_one_rank_float32_on_another(plain):
    if plain.size == 1:
        pytest.skip("needs two ranks (every rank skips alike)")
    dtype = BFLOAT16 if plain.rank == 0 else np.dtype(np.float32)
    with pytest.raises(CollectiveMismatchError) as caught:
        plain.allreduce(np.ones(4, dtype=dtype))
    message = str(caught.value)
    assert "rank 0: #" in message and "bfloat16[4]" in message and "float32[4]" in message
    assert "ranks 1-2" in message if plain.size == 3 else "rank 1:" in message
    with pytest.raises(CollectiveMismatchError) as caught:  # in a fused list: the first array that differs
        plain.allreduce_many([np.ones(3), np.ones(4, dtype=dtype)])
    assert "first difference at array #1" in str(caught.value) and "bfloat16[4]" in str(caught.value)
    assert_bits(plain.allreduce(np.ones(2, dtype=BFLOAT16)), np.full(2, plain.size).astype(BFLOAT16))  # still usable


@pytest.mark.parametrize("name", HALVES)
def test_check_finite_finds_16_bit_nans(name):
    with Communicator(MPI.COMM_WORLD, Options.resolve(env={}, check_finite=True)) as checked:
        for n in (SMALL, LARGE):
            x = np.ones(n, dtype=dtype_of(name))
            x[-1] = np.nan if checked.rank == checked.size - 1 else 1.0
            with pytest.raises(md.NonFiniteError, match=f"rank {checked.size - 1} contributed NaN or Inf"):
                checked.allreduce(x)
            assert (host(x)[:-1] == 1).all()  # nothing was reduced


@pytest.mark.parametrize("other", ["int1", "uint1", "float8_e4m3b11fnuz", "float8_e4m3fn"])
def test_other_ml_dtypes_are_refused(plain, other):
    """ml_dtypes' other types, some of which reuse NumPy's chars ('e', 'E', 'L'), are not taken for those."""
    if not hasattr(ml_dtypes, other):
        pytest.skip(f"this ml_dtypes has no {other} (every rank skips alike)")
    x = np.zeros(4, dtype=getattr(ml_dtypes, other))
    with pytest.raises(TypeError, match=f"has dtype {other}, which mpidist cannot send"):
        plain.allreduce(x)
    with pytest.raises(TypeError, match="cannot send"):
        plain.broadcast(x)


# -- through DLPack -------------------------------------------------------------------------------
_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def as_bfloat16_capsule(capsule: Any) -> Any:
    """A DLPack capsule of a uint16 tensor relabelled bfloat16 (kDLBfloat, 16 bits), as torch and JAX export it."""
    name = _name(capsule)
    dtype = ctypes.c_uint8.from_address(
        _pointer(capsule, name) + {b"dltensor": 0, b"dltensor_versioned": 32}[name] + 20
    )
    assert dtype.value == 1  # kDLUInt
    dtype.value = 4  # kDLBfloat
    return capsule


class BFloat16Tensor(DLPackOnly):
    """Another library's bfloat16 tensor over ``backing``'s memory (uint16 bits), known only through DLPack."""

    def __dlpack__(self, **kwargs: Any) -> Any:
        return as_bfloat16_capsule(self.backing.__dlpack__(**kwargs))


def test_a_bfloat16_dlpack_tensor_arrives_as_ml_dtypes_bfloat16(plain):
    bits = contribution(plain.rank, SMALL, "bfloat16").view(np.uint16).copy()
    tensor = BFloat16Tensor(bits)
    with pytest.raises(Exception):  # noqa: B017 (whatever NumPy raises: it has no bfloat16)
        np.from_dlpack(tensor)
    result = plain.allreduce(tensor, inplace=True)
    assert result.dtype == BFLOAT16 and np.shares_memory(result, bits)
    assert_bits(bits.view(BFLOAT16), expected("sum", plain.size, SMALL, "bfloat16"))  # written into the tensor


# -- on a GPU (the CuPy stand-in) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def device():
    c = Communicator(MPI.COMM_WORLD, Options.resolve(device="gpu", piece_bytes=PIECE))
    yield c
    c.free()


@pytest.mark.gpu
@pytest.mark.parametrize("name", HALVES)
def test_device_arrays_in_every_collective(device, name):
    """bfloat16 device arrays (CuPy 14, the stand-in): reduced through float32 on the device, moved as bits."""
    xp = device.backend.xp
    for n in (SMALL, LARGE):
        x = xp.asarray(contribution(device.rank, n, name))
        for op in ("sum", "mean"):
            assert_bits(device.allreduce(x, op), expected(op, device.size, n, name))
            assert_bits(device.iallreduce(x, op).wait(), expected(op, device.size, n, name))
        results = device.allreduce_many([x, xp.asarray(contribution(device.rank, 5, name))])
        assert_bits(results[0], expected("sum", device.size, n, name))
        assert_bits(results[1], expected("sum", device.size, 5, name))
        assert type(results[0]) is xp.ndarray and results[0].dtype == dtype_of(name)
    rows = 2 * device.size
    block = device.reduce_scatter(xp.asarray(contribution(device.rank, rows, name)), "sum")
    assert_bits(block, expected("sum", device.size, rows, name)[2 * device.rank : 2 * device.rank + 2])
    x = xp.asarray(bit_patterns(device.rank, 99, name))
    assert_bits(device.broadcast(x, root=device.size - 1), bit_patterns(device.size - 1, 99, name))
    gathered = device.allgather(xp.asarray(bit_patterns(device.rank, device.rank + 1, name)))
    assert_bits(gathered, np.concatenate([bit_patterns(r, r + 1, name) for r in range(device.size)]))
    received, _ = device.alltoall(xp.asarray(bit_patterns(device.rank, 2 * device.size, name)))
    mine = slice(2 * device.rank, 2 * device.rank + 2)
    assert_bits(received, np.concatenate([bit_patterns(r, 2 * device.size, name)[mine] for r in range(device.size)]))
    at_root = device.gather(xp.asarray(bit_patterns(device.rank, 3, name)), root=0)
    if device.rank == 0:
        assert_bits(at_root, np.concatenate([bit_patterns(r, 3, name) for r in range(device.size)]))


@pytest.mark.gpu
def test_a_bfloat16_device_tensor_through_dlpack(device):
    """CuPy imports no bfloat16 through DLPack (13; 14 before it did, as the stand-in): its bits, viewed."""
    xp = device.backend.xp
    bits = xp.asarray(contribution(device.rank, SMALL, "bfloat16").view(np.uint16))
    result = device.allreduce(BFloat16Tensor(bits), inplace=True)
    assert type(result) is xp.ndarray and result.dtype == BFLOAT16
    assert_bits(bits.view(BFLOAT16), expected("sum", device.size, SMALL, "bfloat16"))  # written into the tensor


@pytest.mark.gpu
def test_a_cupy_without_bfloat16_refuses_the_tensor(device, monkeypatch):
    """As CuPy 13, which has no bfloat16: the rank with the tensor raises TypeError, the others a mismatch."""
    xp = device.backend.xp
    view = xp.ndarray.view

    def no_bfloat16(self: Any, dtype: Any = None) -> Any:
        if dtype is not None and np.dtype(dtype) == BFLOAT16:
            raise ValueError("Unsupported dtype bfloat16")
        return view(self, dtype)

    monkeypatch.setattr(xp.ndarray, "view", no_bfloat16)
    bits = xp.zeros(4, dtype=np.uint16)
    value = BFloat16Tensor(bits) if device.rank == 0 else xp.zeros(4, dtype=np.float32)
    expected_error = TypeError if device.rank == 0 else CollectiveMismatchError
    with pytest.raises(expected_error, match="bfloat16"):
        device.allreduce(value)
    monkeypatch.undo()
    assert_bits(device.allreduce(xp.ones(2, dtype=BFLOAT16)), np.full(2, device.size).astype(BFLOAT16))
