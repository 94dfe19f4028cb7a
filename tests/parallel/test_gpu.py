"""Device-buffer paths: CuPy arrays, host staging and CUDA-aware MPI.

These run where CuPy sees a CUDA device (``-m gpu``), or on the CPU stand-in for
CuPy (``MPIDIST_TEST_DEVICE=standin``, see tests/helpers/standin/README.md). The
transfer path follows the run's ``MPIDIST_CUDA_AWARE``: ``1`` hands device
buffers to MPI, ``0`` stages them through pinned host memory, ``auto`` asks
the MPI library. On the stand-in every test also checks (tests/conftest.py)
that no device buffer reached MPI before its stream was synchronised and that
nothing was converted to the host implicitly; the tests taking
``device_ledger`` count the copies between host and device of each path.

Copies between host and device per call, when staged (none when CUDA-aware):
allreduce, broadcast, one fused bucket or piece of ``reduce_apply``: one each
way; allgather and reduce_scatter: the input and the output buffer to the
host, the output back. Every rank makes the same calls in the same order.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from arrays import assert_close, assert_equal
from mpidist._comm import cuda_aware as cuda_aware_module
from mpidist._comm.backend import Backend
from mpidist._comm.communicator import Communicator
from mpidist._comm.cuda_aware import decide_cuda_aware, library_cuda_support
from mpidist._options import Options

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]

SETTING = os.environ.get("MPIDIST_CUDA_AWARE", "auto")


@pytest.fixture(scope="module")
def comm():
    """A GPU communicator whose transfer path follows ``MPIDIST_CUDA_AWARE``."""
    c = Communicator(MPI.COMM_WORLD, Options.resolve(device="gpu", piece_bytes=4096))
    yield c
    c.free()


@pytest.fixture(scope="module")
def strategy():
    s = md.MPIStrategy(device="gpu", piece_bytes=4096)
    yield s
    s.free()


def staged_copies(comm, h2d, d2h):
    """The copies a path makes: as given when staged, none when MPI takes device buffers."""
    return (0, 0) if comm.cuda_aware else (h2d, d2h)


def assert_copies(ledger, comm, h2d, d2h):
    assert ledger.copies() == staged_copies(comm, h2d, d2h), ledger.snapshot()
    assert ledger.implicit == []  # no attempt at an implicit host conversion either
    if comm.cuda_aware:
        # MPI was really handed the device buffers (a reduction over one rank makes no MPI call)
        assert ledger.mpi_reads > 0 or comm.size == 1
    else:
        assert ledger.mpi_reads == 0  # MPI only ever saw host buffers


# -- binding and the transfer decision ---------------------------------------------------------
def test_rank_is_bound_to_its_node_local_gpu(comm):
    import cupy

    assert comm.backend.is_gpu and comm.backend.xp is cupy
    assert comm.backend.device_id == comm.local_rank % cupy.cuda.runtime.getDeviceCount()
    assert cupy.cuda.Device().id == comm.backend.device_id
    assert cupy.full(2, 1.0).device.id == comm.backend.device_id


def test_transfer_path_follows_the_setting(comm):
    decision = decide_cuda_aware(MPI.COMM_WORLD, comm.backend, SETTING)
    assert comm.cuda_aware is decision.enabled
    if SETTING in ("0", "1"):
        assert decision.enabled is (SETTING == "1") and decision.source == "setting"
        assert f"cuda_aware={SETTING!r}" in decision.reason
    else:
        supported = library_cuda_support()
        assert decision.source == ("self-test" if supported else "query")
        if not supported:
            assert decision.enabled is False
    host = decide_cuda_aware(MPI.COMM_WORLD, Backend.select("cpu"), "1")
    assert host.enabled is False and host.source == "host"


@pytest.mark.parametrize("setting", ["0", "1"])
def test_rank_zero_reports_the_transfer_path_once(comm, caplog, setting):
    cuda_aware_module._reported.clear()
    with caplog.at_level(logging.INFO, logger="mpidist.comm"):
        for _ in range(2):
            assert cuda_aware_module.resolve_cuda_aware(comm.mpi_comm, comm.backend, setting).enabled is (
                setting == "1"
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "mpidist.comm"]
    if comm.rank == 0:
        path = "go to MPI directly (CUDA-aware)" if setting == "1" else "staged through pinned host memory"
        assert len(lines) == 1 and path in lines[0] and f"cuda_aware={setting!r}" in lines[0]
    else:
        assert lines == []


# -- collectives on device arrays ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "complex64"])
@pytest.mark.parametrize("mode", ["new", "inplace", "nonblocking"])
def test_device_allreduce(comm, dtype, mode):
    import cupy

    n, r = comm.size, comm.rank
    want = (np.arange(3000) % 5 * sum(q + 1 for q in range(n))).astype(dtype)  # > piece_bytes: pieces
    for _ in range(2):
        mine = cupy.asarray((np.arange(3000) % 5 * (r + 1)).astype(dtype))
        if mode == "inplace":
            out = comm.allreduce(mine, "sum", inplace=True)
            assert out is mine
        elif mode == "nonblocking":
            out = comm.iallreduce(mine, "sum").wait()
        else:
            out = comm.allreduce(mine, "sum")
        assert isinstance(out, cupy.ndarray)
        assert_equal(out, want)


def test_device_broadcast_allgather_reduce_scatter(comm):
    import cupy

    n, r = comm.size, comm.rank
    for _ in range(2):
        b = comm.broadcast(cupy.full(5, r, dtype=cupy.float32), root=n - 1)
        assert_equal(b, np.full(5, n - 1, np.float32))
        g = comm.allgather(cupy.full((r + 1, 2), r, dtype=cupy.int64))
        assert isinstance(g, cupy.ndarray)
        assert_equal(g, np.concatenate([np.full((q + 1, 2), q) for q in range(n)]))
        rows = 2 * n
        block = comm.reduce_scatter(cupy.ones((rows, 3)), "mean")
        assert_equal(block, np.ones((2, 3)))


@pytest.mark.parametrize("elements", [16, 1000, 5000])  # one piece, the whole pipeline piece, several pieces
@pytest.mark.parametrize("mode", ["new", "inplace", "nonblocking"])
def test_allreduce_copies(comm, device_ledger, elements, mode):
    import cupy

    n, r = comm.size, comm.rank
    for _ in range(2):
        mine = cupy.full(elements, r + 1, dtype=cupy.float32)
        device_ledger.reset()
        if mode == "inplace":
            out = comm.allreduce(mine, "mean", inplace=True)
        elif mode == "nonblocking":
            out = comm.iallreduce(mine, "mean").wait()
        else:
            out = comm.allreduce(mine, "mean")
        assert_copies(device_ledger, comm, h2d=1, d2h=1)
        assert_close(out, np.full(elements, (n + 1) / 2, np.float32))


def test_broadcast_allgather_reduce_scatter_copies(comm, device_ledger):
    import cupy

    n, r = comm.size, comm.rank
    x = cupy.full(7, r, dtype=cupy.int32)
    device_ledger.reset()
    comm.broadcast(x, root=0)
    assert_copies(device_ledger, comm, h2d=1, d2h=1)
    device_ledger.reset()
    g = comm.allgather(x)
    assert_copies(device_ledger, comm, h2d=1, d2h=2)
    device_ledger.reset()
    block = comm.reduce_scatter(cupy.ones((n, 3), dtype=cupy.float64))
    assert_copies(device_ledger, comm, h2d=1, d2h=2)
    assert_equal(g, np.zeros(7 * n, np.int32))
    assert_equal(block, np.full((1, 3), float(n)))


@pytest.mark.parametrize("sizes", [[3, 5, 7], [2000, 3, 1500]])  # one bucket; a large array and a bucket
def test_fused_reduction_copies(comm, device_ledger, sizes):
    import cupy

    n, r = comm.size, comm.rank
    arrays = [cupy.full(k, r + 1.0, dtype=cupy.float32) for k in sizes]
    device_ledger.reset()
    out = comm.allreduce_many(arrays, "sum")
    calls = sum(-(-4 * k // 4096) for k in sizes if 4 * k > 4096) + (1 if any(4 * k <= 4096 for k in sizes) else 0)
    assert_copies(device_ledger, comm, h2d=calls, d2h=calls)
    for k, o in zip(sizes, out):
        assert isinstance(o, cupy.ndarray) and o.shape == (k,)
        assert_equal(o, np.full(k, n * (n + 1) / 2, np.float32))
    for a in arrays:  # the inputs are left as they were
        assert_equal(a, np.full(a.size, r + 1.0, np.float32))


def test_nonblocking_fused_reduction(comm, device_ledger):
    import cupy

    n, r = comm.size, comm.rank
    arrays = [cupy.full(k, r + 1, dtype=cupy.int64) for k in (4, 600)]
    handle = comm.iallreduce_many(arrays, "max")
    arrays[0][...] = -1  # the inputs were copied when the call started
    out = handle.wait()
    assert_copies(device_ledger, comm, h2d=1, d2h=1)  # one buffer per dtype
    assert_equal(out[0], np.full(4, n, np.int64))
    assert_equal(out[1], np.full(600, n, np.int64))


@pytest.mark.parametrize("where", ["device", "mixed"])  # mixed: on the device on even ranks, the host on odd
@pytest.mark.parametrize("path", ["out", "update", "in_place"])
def test_two_level_pipeline_wherever_the_data_is(device_ledger, where, path):
    """An array of many pieces takes the two-level pipeline whether its data is on the device or, on some ranks,
    on the host: where the data is never changes the MPI calls (a mismatch would end at the deadline), and every
    path gives the exact mean. Staged, the input goes to the host once and each piece comes back as it lands."""
    import cupy

    from test_comm import contribution, expected

    c = Communicator(
        MPI.COMM_WORLD, Options.resolve(device="gpu", piece_bytes=1024, hierarchical=True, node_size=1, timeout=20.0)
    )
    n, r = c.size, c.rank
    shape = (41, 97)  # float64: 32 pieces of 1 KiB, the last ragged
    on_device = where == "device" or r % 2 == 0
    xp = cupy if on_device else np
    send = xp.asarray(contribution(r, shape, "float64"))
    want = expected("mean", n, shape, "float64")
    device_ledger.reset()
    if path == "out":
        out = c.allreduce_many([send], md.ReduceOp.MEAN, ["x"], out=[xp.empty(shape)])[0]
    else:
        out = xp.ones(shape)
        c.reduce_apply([send], [out], [md.ReduceOp.MEAN], lambda t, m: t.__iadd__(m), ["x"], path == "in_place")
        want = want + 1
    pieces = -(-send.nbytes // 1024)
    if on_device:
        assert_copies(device_ledger, c, h2d=pieces, d2h=1)
    assert isinstance(out, type(send))
    assert_equal(out, want)
    assert_equal(send, want - 1 if path == "in_place" else contribution(r, shape, "float64"))
    c.free()


@pytest.mark.parametrize("fused", [False, True])
def test_small_arrays_on_the_device_on_some_ranks_only_are_refused(comm, fused):
    """A small reduction whose array is on the device on rank 0 and on the host elsewhere is refused on every rank,
    naming where each rank's data is (a small host array travels inside the agreement, a device one does not, so
    the calls would not pair), and nothing is modified."""
    import cupy

    if comm.size == 1:
        pytest.skip("needs ranks that hold their data in different places")
    r = comm.rank
    x = (cupy if r == 0 else np).full(3, r + 1.0, dtype=np.float32)
    with pytest.raises(md.CollectiveMismatchError) as info:
        if fused:
            comm.allreduce_many([x], "sum")
        else:
            comm.allreduce(x, "sum")
    place = "ranks 1-2: host memory" if comm.size == 3 else "rank 1: host memory"
    assert "ranks disagree on where the data of collective #" in str(info.value)
    assert f"rank 0: device memory; {place}" in str(info.value)
    assert_equal(x, np.full(3, r + 1.0, np.float32))
    comm.allreduce(np.ones(1), "sum")  # the communicator is still usable (a refusal before any data moved)


# -- every agreement check off: the direct paths still synchronise ------------------------------------
UNCHECKED = dict(check_collectives=False, timeout=None, check_finite=False)  # no agreement step at all


@pytest.fixture(scope="module")
def unchecked():
    """:func:`comm` with every agreement check off: collectives go straight to the data."""
    c = Communicator(MPI.COMM_WORLD, Options.resolve(device="gpu", piece_bytes=4096, **UNCHECKED))
    yield c
    c.free()


def assert_synchronised(ledger, comm):
    """No device buffer reached MPI with unfinished work writing it (and MPI saw some, when CUDA-aware)."""
    assert ledger.violations == [], ledger.violations
    assert ledger.implicit == []
    if comm.cuda_aware and comm.size > 1:
        assert ledger.mpi_reads > 0, ledger.snapshot()


@pytest.mark.parametrize("elements", [1, 16, 1024])  # one piece: the direct path of small arrays
@pytest.mark.parametrize("mode", ["new", "inplace", "out", "nonblocking"])
def test_unchecked_small_allreduce_synchronises(unchecked, device_ledger, elements, mode):
    import cupy

    n, r = unchecked.size, unchecked.rank
    out = cupy.empty(elements, dtype=cupy.float32)
    for _ in range(2):
        mine = cupy.full(elements, r + 1, dtype=cupy.float32)  # queued on the stream, not finished
        device_ledger.reset()
        if mode == "inplace":
            result = unchecked.allreduce(mine, "sum", inplace=True)
        elif mode == "out":
            result = unchecked.allreduce(mine, "sum", out=out)
        elif mode == "nonblocking":
            result = unchecked.iallreduce(mine, "sum").wait()
        else:
            result = unchecked.allreduce(mine, "sum")
        assert_synchronised(device_ledger, unchecked)
        assert_equal(result, np.full(elements, n * (n + 1) / 2, np.float32))


def test_unchecked_broadcast_and_allgather_synchronise(unchecked, device_ledger):
    import cupy

    n, r = unchecked.size, unchecked.rank
    x = cupy.full(7, r, dtype=cupy.int32)
    device_ledger.reset()
    b = unchecked.broadcast(x, root=n - 1)
    g = unchecked.allgather(cupy.full(3, r, dtype=cupy.int64))
    h = unchecked.ibroadcast(cupy.full(2, r, dtype=cupy.float64), root=0).wait()
    assert_synchronised(device_ledger, unchecked)
    assert_equal(b, np.full(7, n - 1, np.int32))
    assert_equal(h, np.zeros(2))
    assert_equal(g, np.repeat(np.arange(n), 3))


@pytest.mark.parametrize("sizes", [[5], [3, 5, 7]])  # one array (the per-update path), one bucket
def test_unchecked_fused_reductions_synchronise(unchecked, device_ledger, sizes):
    import cupy

    n, r = unchecked.size, unchecked.rank
    arrays = [cupy.full(k, r + 1.0, dtype=cupy.float32) for k in sizes]
    device_ledger.reset()
    out = unchecked.allreduce_many(arrays, "sum")
    later = unchecked.iallreduce_many([a * 2 for a in arrays], "sum").wait()
    assert_synchronised(device_ledger, unchecked)
    for k, o, twice in zip(sizes, out, later):
        assert_equal(o, np.full(k, n * (n + 1) / 2, np.float32))
        assert_equal(twice, np.full(k, n * (n + 1), np.float32))


def test_unchecked_mirrored_update_synchronises(device_ledger):
    import cupy

    s = md.MPIStrategy(device="gpu", piece_bytes=4096, **UNCHECKED)
    try:
        n, r = s.num_replicas_in_sync, s.rank
        with s.scope():
            v = md.Variable(cupy.zeros(2, dtype=cupy.float32), name="w", aggregation=md.VariableAggregation.MEAN)
        for step in range(1, 4):
            grad = cupy.full(2, r + 1, dtype=cupy.float32)  # written just before the update
            device_ledger.reset()
            s.run(lambda: v.assign_add(grad))
            assert_synchronised(device_ledger, s.communicator)
            assert_close(v.read_value(), np.full(2, step * (n + 1) / 2, np.float32))
    finally:
        s.free()


@pytest.mark.parametrize("checked", [True, False])
def test_host_out_for_a_device_input_is_refused(comm, unchecked, device_ledger, checked):
    """MPI would read the device input past its synchronisation (or get a device pointer it cannot read)."""
    import cupy

    c = comm if checked else unchecked
    n = c.size
    mine = cupy.ones(4)
    with pytest.raises(ValueError, match=r"out= must be a device array like the input, got a numpy\.ndarray"):
        c.allreduce(mine, "sum", out=np.empty(4))
    with pytest.raises(ValueError, match=r"out\[1\] must be a device array like the value it receives"):
        c.allreduce_many([mine, mine], "sum", out=[cupy.empty(4), np.empty(4)])
    for elements in (4, 5000):  # the other way round works: one piece, and several
        host, out = np.ones(elements), cupy.full(elements, -1.0)  # out still being written
        device_ledger.reset()
        assert_equal(c.allreduce(host, "sum", out=out), np.full(elements, float(n)))
        out[...] = -1.0
        assert_equal(c.allreduce_many([host], "sum", out=[out])[0], np.full(elements, float(n)))
        assert device_ledger.violations == [], device_ledger.violations  # (the agreement may carry small sums)


# -- variables and strategies on the device ----------------------------------------------------------
def test_mirrored_update_copies(strategy, device_ledger):
    import cupy

    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        v = md.Variable(cupy.zeros(100, dtype=cupy.float32), name="w", aggregation=md.VariableAggregation.MEAN)
    assert isinstance(v.component, cupy.ndarray)
    grad = cupy.full(100, r + 1, dtype=cupy.float32)
    for step in range(1, 4):
        device_ledger.reset()
        strategy.run(lambda: v.assign_add(grad))
        assert_copies(device_ledger, strategy.communicator, h2d=1, d2h=1)  # one piece per update
        assert_close(v.read_value(), np.full(100, step * (n + 1) / 2, np.float32))


@pytest.mark.parametrize("flat", [False, True])
def test_batch_update_of_many_variables(device_ledger, flat):
    import cupy

    s = md.MPIStrategy(device="gpu", flat_variables=flat, piece_bytes=4096)
    try:
        n, r = s.num_replicas_in_sync, s.rank
        shapes = [(3, 4), (700,), (5,), (2000,)]
        with s.scope():
            variables = [
                md.Variable(cupy.zeros(shape, dtype=cupy.float32), name=f"v{i}", aggregation=md.VariableAggregation.SUM)
                for i, shape in enumerate(shapes)
            ]
        grads = s.flat_zeros_like(variables) if flat else [cupy.zeros(shape, cupy.float32) for shape in shapes]
        for g in grads:
            g[...] = r + 1
        device_ledger.reset()
        s.run(lambda: s.batch_update(list(zip(variables, grads)), in_place=True))
        h2d, d2h = device_ledger.copies()
        if s.communicator.cuda_aware:
            assert (h2d, d2h) == (0, 0) and (device_ledger.mpi_reads > 0 or n == 1)  # one rank: no MPI call
        else:  # one copy each way per MPI call: flat spans in pieces, others in buckets
            total = sum(int(np.prod(shape)) for shape in shapes) * 4
            assert h2d == d2h and 1 <= h2d <= -(-total // 4096) + len(shapes)
        for v, g in zip(variables, grads):
            assert_equal(v.read_value(), np.full(v.shape, n * (n + 1) / 2, np.float32))
            assert_equal(g, np.full(v.shape, n * (n + 1) / 2, np.float32))  # in_place: the sums
    finally:
        s.free()


def test_sync_on_read_variable_on_the_device(strategy, device_ledger):
    import cupy

    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        v = md.Variable(
            cupy.zeros(3, dtype=cupy.float64),
            name="count",
            synchronization=md.VariableSynchronization.ON_READ,
            aggregation=md.VariableAggregation.SUM,
        )
    strategy.run(lambda: v.assign_add(cupy.full(3, r + 1.0)))
    device_ledger.reset()
    total = strategy.read_var(v)
    assert_copies(device_ledger, strategy.communicator, h2d=1, d2h=1)
    assert isinstance(total, cupy.ndarray)
    assert_equal(total, np.full(3, n * (n + 1) / 2))


def test_strategy_reduce_and_gather_on_the_device(strategy):
    import cupy

    n, r = strategy.num_replicas_in_sync, strategy.rank
    value = md.PerReplica({r: cupy.full((2, 3), r + 1.0)})
    assert_equal(strategy.reduce("sum", value), np.full((2, 3), n * (n + 1) / 2))
    assert_equal(strategy.reduce("mean", value, axis=0), np.full(3, (n + 1) / 2))
    many = strategy.reduce("max", [value, md.PerReplica({r: cupy.arange(4) + r})])
    assert_equal(many[0], np.full((2, 3), float(n)))
    assert_equal(many[1], np.arange(4) + n - 1)
    gathered = strategy.gather(md.PerReplica({r: cupy.full((2, r + 1), r)}), axis=1)
    assert isinstance(gathered, cupy.ndarray)
    assert_equal(gathered, np.concatenate([np.full((2, q + 1), q) for q in range(n)], axis=1))
    assert strategy.check_mirrored([]) == {}


def test_exact_metrics_copy_values_and_state_once_per_update(strategy, device_ledger):
    import cupy

    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        mean = md.Mean()
    values = cupy.asarray(np.array([0.1, 0.2, 0.3]) * (r + 1))
    device_ledger.reset()
    mean.update_state(values)
    # The exact sum is computed on the host: the values and the state come over once, the state goes back.
    assert device_ledger.copies() == (1, 2)
    result = mean.result()
    want = sum(0.6 * (q + 1) for q in range(n)) / (3 * n)
    assert abs(float(result) - want) < 1e-15


def test_doctor_gpu_rows_and_transfer_path(comm):
    """The doctor's per-rank GPU rows and the CUDA-aware line, from device arrays, with no implicit host copy."""
    from mpidist._tools.doctor import collect, diagnose, format_report

    report = collect(device="gpu")
    if comm.rank == 0:
        text = format_report(report, diagnose(report))
        assert all(r["gpu"] is not None for r in report["ranks"]), report["ranks"]
        assert report["cuda_aware"] == comm.cuda_aware and report["cuda_aware_reason"] == comm.cuda_awareness.reason
        assert f"CUDA-aware MPI  {'yes' if comm.cuda_aware else 'no'}: {comm.cuda_awareness.reason}" in text, text
        assert "arrays" in text and "CuPy" in text, text
    else:
        assert report is None
