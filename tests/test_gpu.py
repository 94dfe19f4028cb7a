"""Device-buffer paths of the Communicator: CuPy arrays, host staging and CUDA-aware MPI.

These run only where CuPy sees a CUDA device (``-m gpu``); the CPU suite
covers the same collectives with NumPy arrays. Every rank makes the same
calls in the same order.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from arrays import assert_equal
from mpidist._comm.communicator import Communicator
from mpidist._options import Options

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


@pytest.fixture(scope="module", params=["0", "auto"])
def comm(request):
    """A GPU communicator that stages through host memory ("0") or detects CUDA-awareness."""
    c = Communicator(MPI.COMM_WORLD, Options(device="gpu", cuda_aware=request.param, pipeline_bytes=4096))
    yield c
    c.free()


def test_rank_is_bound_to_its_node_local_gpu(comm):
    import cupy

    assert comm.backend.is_gpu and comm.backend.xp is cupy
    assert comm.backend.device_id == comm.local_rank % cupy.cuda.runtime.getDeviceCount()
    assert cupy.cuda.Device().id == comm.backend.device_id
    if comm.options.cuda_aware == "0":
        assert comm.cuda_aware is False


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "complex64"])
@pytest.mark.parametrize("mode", ["new", "inplace", "nonblocking"])
def test_device_allreduce(comm, dtype, mode):
    import cupy

    n, r = comm.size, comm.rank
    want = (np.arange(3000) % 5 * sum(q + 1 for q in range(n))).astype(dtype)  # > pipeline_bytes: pieces
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
