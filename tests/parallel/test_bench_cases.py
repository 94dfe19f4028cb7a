"""The benchmark's cases under MPI, at 1, 2 and 3 ranks: what their variants do and count.

A ratio against a baseline means something only if both move the same data: here each ``alltoall``
variant's call is made once, after its write, on every rank, and what mpidist received is compared
with what the raw calls received (the rows and, for uneven splits, the counts). The ``scaling``
case counts the MPI calls each of its collectives makes (the library's messages are counted only
under Open MPI started with its monitoring on: ``tests/unit/test_bench_scaling.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpidist._tools import bench as bench_module
from mpidist._tools.bench_counts import CallCounter

pytestmark = pytest.mark.mpi


def _constant(x):
    return x.size == 0 or bool(np.all(x == x[0]))


@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
@pytest.mark.parametrize("nbytes", [8, 1024, 1 << 17])
def test_alltoall_variants_receive_what_the_raw_calls_receive(nbytes, even):
    bench = bench_module.Bench(repeats=1, torch_dist=None)
    strategies = bench_module.make_strategies()
    variants, sent = bench_module.alltoall_variants(bench, strategies, nbytes, even)
    rows, n, r = sent // 4, bench.size, bench.rank
    assert rows % n == 0 and rows >= n and sent <= max(nbytes, 4 * n)
    # rank q sends rows[r] of its splits to this rank; every row it sends holds 1 + q + (a constant of the write)
    counts = [rows // n if even else bench_module.uneven_splits(rows, q, n)[r] for q in range(n)]
    sources = np.concatenate([np.full(c, q, np.float32) for q, c in enumerate(counts)])
    for name, variant in variants.items():
        variant.write()
        result = variant.call()
        received, received_counts = (result, counts) if name == "raw" and even else result
        np.testing.assert_array_equal(received_counts, counts, err_msg=name)
        assert received.shape == (sum(counts),) and received.dtype == np.float32, name
        assert _constant(received - sources), (name, received)
    for s in strategies.values():
        s.free()
    bench.comm.Free()


def test_the_scaling_case_counts_the_mpi_calls_of_each_collective():
    """mpidist's agreement is one MPI call (the start of its persistent allreduce), which carries the 8-byte update
    and is the barrier; the 1 MiB allreduce adds one reduction call. The counting stand-ins come and go."""
    bench = bench_module.Bench(repeats=1, torch_dist=None)
    strategies = bench_module.make_strategies()
    strategy = strategies["check"]
    agreement = strategy.communicator.agreement
    comm, request = agreement.transport.comm, agreement.request
    calls = CallCounter()
    with calls.installed(strategy.communicator):
        assert agreement.transport.comm is not comm and agreement.request is not request
        variants = bench_module.scaling_variants(bench, strategy, calls.wrap(bench.comm))
        counted = {key: {name: bench.count(v, calls, None) for name, v in vs.items()} for key, vs in variants.items()}
    assert agreement.transport.comm is comm and agreement.request is request
    # one rank reduces nothing; with a deadline the reduction is the nonblocking call, polled
    reduction = {} if bench.size == 1 else {"Iallreduce" if strategy.options.timeout is not None else "Allreduce": 1.0}
    expected = {
        "update_8B": ({"Allreduce": 1.0}, {"Start": 1.0}),
        "allreduce_1MiB": ({"Allreduce": 1.0}, {"Start": 1.0, **reduction}),
        "barrier": ({"Barrier": 1.0}, {"Start": 1.0}),
    }
    assert set(counted) == set(expected)
    for key, (raw, mine) in expected.items():
        assert counted[key]["raw"]["mpi_calls"] == raw, key
        assert counted[key]["mpidist"]["mpi_calls"] == mine, key
        for count in counted[key].values():
            assert count["mpi_calls_alike"] and count["messages"] is None and count["bytes"] is None, key
    for s in strategies.values():
        s.free()
    bench.comm.Free()
