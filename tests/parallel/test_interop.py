"""Arrays of other libraries as values: DLPack (torch, JAX, array-API libraries) and ``__array__``.

Such arrays are used without a copy where their library allows (``numpy.from_dlpack`` for host
memory, ``cupy.from_dlpack`` for device memory), so a collective that writes into its argument
(in place, ``out=``) writes into the caller's object; results are NumPy or CuPy arrays, by where
the memory lies. Variables copy their initial value. The objects are array-api-strict's arrays
(a real DLPack library, when installed) and the stand-ins of tests/helpers/foreign.py over NumPy
memory, and over CuPy memory (a torch-CUDA-like tensor) where a GPU or the CuPy stand-in is
there. Expected values derive from rank and size.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import DEVICES, assert_equal
from foreign import DEVICE_KINDS, HOST_KINDS, DLPackOnly, RequiresGrad, TorchLike
from mpidist import CollectiveMismatchError, MPIStrategy, PerReplica, ReduceOp
from mpidist._comm.backend import as_array, data_pointer

try:
    import array_api_strict
except ImportError:  # needs Python 3.10 or later; the protocol stand-ins still run
    array_api_strict = None

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=DEVICES)
def strategy(request):
    s = MPIStrategy(device=request.param)
    yield s
    s.free()


def _strict(backing):
    return array_api_strict.asarray(backing, copy=False)  # shares the NumPy array's memory


def kinds(strategy):
    """``(name, make, xp)``: ``make(array of module xp)`` is another library's array over that array's memory.

    Host memory on a NumPy strategy; on a GPU strategy device memory (a result is then CuPy), and
    one kind over host memory (a result is then NumPy, as for a NumPy array).
    """
    if strategy.backend.is_gpu:
        cp = strategy.backend.xp
        return [(k.__name__, k, cp) for k in DEVICE_KINDS] + [("TorchLike(host)", TorchLike, np)]
    made = [(k.__name__, k, np) for k in HOST_KINDS]
    if array_api_strict is not None:
        made.append(("array_api_strict", _strict, np))
    return made


def same_memory(a, b):
    return data_pointer(a) == data_pointer(b)


def test_reduce_of_foreign_arrays_is_right_on_every_rank(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    total = n * (n + 1) / 2
    for name, make, xp in kinds(strategy):
        backing = xp.full(3, r + 1.0)
        value = make(backing)
        for _ in range(2):  # twice: nothing is cached wrongly between calls
            result = strategy.reduce("sum", value)
            assert type(result) is xp.ndarray, name
            assert_equal(result, [total] * 3)
        assert_equal(strategy.reduce(ReduceOp.MEAN, value), [total / n] * 3)
        assert_equal(strategy.reduce("sum", PerReplica({r: value})), [total] * 3)
        assert_equal(strategy.reduce("sum", value, axis=0), 3 * total)
        nest = strategy.reduce("sum", {"a": value, "b": [make(xp.full(2, 1.0))]})
        assert_equal(nest["a"], [total] * 3)
        assert_equal(nest["b"][0], [n, n])
        assert_equal(strategy.reduce_async("sum", value).wait(), [total] * 3)
        assert_equal(backing, [r + 1.0] * 3)  # reductions into new arrays leave the value as it is


def test_reduce_and_gather_write_into_a_foreign_out(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    for name, make, xp in kinds(strategy):
        into = xp.zeros(2)
        result = strategy.reduce("sum", xp.full(2, r + 1.0), out=make(into))
        assert_equal(into, [n * (n + 1) / 2] * 2)
        assert same_memory(result, into), name
        first, second = xp.zeros(2), xp.zeros(3)
        strategy.reduce("max", [xp.full(2, float(r)), xp.full(3, -float(r))], out=[make(first), make(second)])
        assert_equal(first, [n - 1.0] * 2)
        assert_equal(second, [0.0] * 3)
        gathered = strategy.gather(make(xp.full((r + 1, 2), float(r))), axis=0)
        assert type(gathered) is xp.ndarray, name
        assert_equal(gathered, np.repeat(np.arange(n, dtype=float), np.arange(1, n + 1))[:, None] * np.ones(2))


def test_run_passes_foreign_arguments_and_wraps_its_results(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    for name, make, xp in kinds(strategy):
        value = make(xp.full(2, r + 1.0))
        seen = []

        def fn(x):
            seen.append(x)
            return x

        result = strategy.run(fn, args=(PerReplica({r: value}),))
        assert seen == [value]  # the object itself, unconverted: fn works in its own library
        assert isinstance(result, PerReplica) and result.get(r) is value, name
        assert_equal(strategy.reduce("sum", result), [n * (n + 1) / 2] * 2)


def test_collectives_write_into_the_callers_memory(strategy):
    comm = strategy.communicator
    n, r = comm.size, comm.rank
    total = n * (n + 1) / 2
    for name, make, xp in kinds(strategy):
        backing = xp.full(4, r + 1.0)
        result = comm.allreduce(make(backing), inplace=True)
        assert_equal(backing, [total] * 4)
        assert type(result) is xp.ndarray and same_memory(result, backing), name

        into = xp.zeros(4)
        assert same_memory(comm.allreduce(xp.full(4, r + 1.0), out=make(into)), into)
        assert_equal(into, [total] * 4)

        backing = xp.full(3, r + 1.0)
        comm.iallreduce(make(backing), "max", inplace=True).wait()
        assert_equal(backing, [float(n)] * 3)

        backing = xp.full(2, float(r))
        comm.broadcast(make(backing), root=n - 1)
        assert_equal(backing, [n - 1.0] * 2)
        backing = xp.full(2, float(r))
        comm.ibroadcast(make(backing), root=0).wait()
        assert_equal(backing, [0.0] * 2)

        expected = np.repeat(np.arange(n, dtype=float), np.arange(1, n + 1))
        gathered = comm.allgather(make(xp.full(r + 1, float(r))))
        assert type(gathered) is xp.ndarray
        assert_equal(gathered, expected)
        into = xp.zeros(len(expected))
        comm.allgather(make(xp.full(r + 1, float(r))), out=make(into))
        assert_equal(into, expected)
        assert_equal(comm.iallgather(make(xp.full(r + 1, float(r)))).wait(), expected)

        block = comm.reduce_scatter(make(xp.ones((2 * n, 3))))
        assert type(block) is xp.ndarray
        assert_equal(block, np.full((2, 3), float(n)))

        outs = [xp.zeros(2), xp.zeros(5)]
        comm.allreduce_many([make(xp.ones(2)), make(xp.full(5, float(r)))], out=[make(o) for o in outs])
        assert_equal(outs[0], [float(n)] * 2)
        assert_equal(outs[1], [n * (n - 1) / 2] * 5)
        assert_equal(comm.iallreduce_many([make(xp.ones(2))]).wait()[0], [float(n)] * 2)


def test_in_place_updates_write_foreign_gradients(strategy):
    """``batch_update(in_place=True)`` overwrites each value with its aggregate: a DLPack value's own memory."""
    n, r = strategy.num_replicas_in_sync, strategy.rank
    for name, make, xp in kinds(strategy):
        with strategy.scope():
            w = md.Variable(np.zeros(3), aggregation="mean", name=f"w_{name}")
        kept, overwritten = xp.full(3, r + 1.0), xp.full(3, r + 1.0)
        strategy.run(lambda: strategy.batch_update([(w, make(kept))], "assign_add"))
        strategy.run(lambda: strategy.batch_update([(w, make(overwritten))], "assign_add", in_place=True))
        assert_equal(w.read_value(), [n + 1.0] * 3)  # twice the mean, (n + 1) / 2
        assert_equal(kept, [r + 1.0] * 3)
        if xp is strategy.backend.xp:  # a value of the variable's module is reduced where it lies
            assert_equal(overwritten, [(n + 1) / 2] * 3)


def test_variables_copy_their_initial_value(strategy):
    for name, make, xp in kinds(strategy):
        backing = xp.full(3, strategy.rank + 1.0)
        with strategy.scope():
            v = md.Variable(make(backing), name=f"v_{name}")
        assert type(v.component) is strategy.backend.xp.ndarray and v.dtype == np.float64, name
        assert_equal(v.read_value(), [1.0] * 3)  # rank 0's value
        if xp is strategy.backend.xp:
            assert not same_memory(v.component, backing)
        backing[...] = 7.0
        with strategy.scope():
            v.assign_add(np.ones(3))
        assert_equal(v.read_value(), [2.0] * 3)
        assert_equal(backing, [7.0] * 3)


def test_updates_take_foreign_values(strategy):
    n, r = strategy.num_replicas_in_sync, strategy.rank
    total = n * (n + 1) / 2
    for name, make, xp in kinds(strategy):
        with strategy.scope():
            m = md.Variable(np.zeros(2), aggregation="sum", name=f"m_{name}")
            s = md.Variable(np.zeros(2), synchronization="on_read", aggregation="sum", name=f"s_{name}")
        value = make(xp.full(2, r + 1.0))
        strategy.run(lambda: m.assign_add(value))
        assert_equal(m.read_value(), [total] * 2)
        strategy.run(lambda: m.assign_sub(value))
        assert_equal(m.read_value(), [0.0] * 2)
        strategy.run(lambda: m.assign(value))
        assert_equal(m.read_value(), [total] * 2)
        strategy.run(lambda: s.assign_add(value))
        with strategy.scope():
            assert_equal(s.read_value(), [total] * 2)
            m.assign(make(xp.full(2, 5.0)))
            m.assign_add(make(xp.ones(1)))  # broadcast to the variable's shape
        assert_equal(m.read_value(), [6.0] * 2)


def test_a_value_its_library_refuses_raises_on_every_rank(strategy):
    """The refusing rank raises the library's own error, the others a mismatch naming the rank and the error."""
    comm = strategy.communicator
    bad = comm.size - 1
    xp = strategy.backend.xp
    with strategy.scope():
        w = md.Variable(np.zeros(2), aggregation="sum", name="w_refusing")
    calls = [
        lambda x: comm.allreduce(x),
        lambda x: comm.iallreduce(x).wait(),
        lambda x: comm.allreduce(xp.ones(2), out=x),
        lambda x: comm.broadcast(x),
        lambda x: comm.allgather(x),
        lambda x: comm.reduce_scatter(x),
        lambda x: comm.allreduce_many([x, xp.ones(2)]),
        lambda x: strategy.reduce("sum", x),
        lambda x: strategy.gather(x),
        lambda x: strategy.broadcast(x),
        lambda x: md.Variable(x, name="refused"),
        lambda x: strategy.run(lambda: w.assign_add(x)),
    ]
    for call in calls:
        mine = RequiresGrad(xp.ones(2)) if comm.rank == bad else xp.ones(2)
        with strategy.scope(), pytest.raises((RuntimeError, CollectiveMismatchError)) as info:
            call(mine)
        if comm.rank == bad:
            assert type(info.value) is RuntimeError and "detach()" in str(info.value)
        else:
            assert isinstance(info.value, CollectiveMismatchError)
            assert f"rank {bad}" in str(info.value) and "RuntimeError" in str(info.value)
    assert_equal(comm.allreduce(xp.ones(1)), [float(comm.size)])  # still in step


def test_conversion_is_a_view_where_the_memory_lies(strategy):
    """Local: ``as_array`` shares memory, never reads a foreign ``.data.ptr``, and leaves the rest as it is."""
    xp = strategy.backend.xp
    backing = xp.arange(4.0)
    for make in (DLPackOnly, TorchLike):
        view = as_array(make(backing))
        assert type(view) is xp.ndarray and same_memory(view, backing)
        assert data_pointer(make(backing)) == data_pointer(backing)  # TorchLike.data is a tensor, not a pointer
    for plain in (backing, 3.0, np.float32(2), [1, 2], "text"):
        assert as_array(plain) is plain


def test_device_memory_without_cupy_is_refused_by_name():
    """A CPU-only install meets a CUDA tensor: a TypeError saying CuPy is needed, not an object array."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy (or its stand-in) is importable here")

    class OnDevice(DLPackOnly):
        def __dlpack_device__(self):
            return 2, 0  # kDLCUDA

    with pytest.raises(TypeError, match=r"rank \d+: 'x': the .*OnDevice lies in GPU memory .*needs CuPy"):
        as_array(OnDevice(np.ones(2)), "'x'", MPI.COMM_WORLD.rank)


@pytest.mark.parametrize("strategy", [DEVICES[1]], indirect=True)
def test_device_arrays_are_imported_without_a_copy(strategy, device_ledger):
    """Another library's device array becomes a CuPy view (``cupy.from_dlpack``): no copy through the host."""
    cp = strategy.backend.xp
    backing = cp.full(4, strategy.rank + 1.0)
    tensor = TorchLike(backing)
    device_ledger.reset()
    for view in (as_array(tensor), strategy.backend.asarray(tensor), strategy.extended.local(tensor)):
        assert type(view) is cp.ndarray and same_memory(view, backing)
    assert device_ledger.dlpack_imports >= 3 and device_ledger.copies() == (0, 0), device_ledger.snapshot()
    device_ledger.reset()
    with strategy.scope():
        v = md.Variable(tensor, name="from_device")
    assert type(v.component) is cp.ndarray and not same_memory(v.component, backing)
    # copied on the device; only the broadcast of the initial value is staged when MPI is not CUDA-aware
    staged = (0, 0) if strategy.communicator.cuda_aware else (1, 1)
    assert device_ledger.copies() == staged, device_ledger.snapshot()
