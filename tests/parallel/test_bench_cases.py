"""The benchmark's ``alltoall`` variants compute the same thing as their raw baselines, at 1, 2 and 3 ranks.

A ratio against a baseline means something only if both move the same data: here each variant's
call is made once, after its write, on every rank, and what mpidist received is compared with what
the raw calls received (the rows and, for uneven splits, the counts).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpidist._tools import bench as bench_module

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
