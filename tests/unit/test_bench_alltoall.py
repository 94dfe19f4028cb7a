"""``python -m mpidist bench``'s ``alltoall`` and ``bfloat16`` cases: their splits, their report, a real run.

Serial tests: the uneven splits for many (rank, size) pairs, the report on made-up results (times and
ratios, no verdict), the inputs of the variants written before every call in a one-rank world, and
the command itself under a real ``mpiexec`` (``tests/helpers/mpirun.py``) with its smallest settings.
The variants' results at 1, 2 and 3 ranks: ``tests/parallel/test_bench_cases.py``.
"""

from __future__ import annotations

import functools
import json
import sys
import types

import numpy as np
import pytest

from mpidist._tools.bench_report import write_reports
from mpirun import run_mpi

TIMEOUT = 120

META = {
    "ranks": 2,
    "mpi": "Open MPI v5.0.11",
    "python": "3.11.7",
    "numpy": "2.0",
    "cpus": 2,
    "machine": "x86_64",
    "date": "2026-01-01 00:00:00",
    "seconds": 1.0,
    "repeats": 2,
    "piece_bytes": 2 << 20,
    "fusion_bytes": 64 << 10,
    "torch": None,
}


def _timed(*samples):
    return {"median_s": sorted(samples)[len(samples) // 2], "samples_s": list(samples), "iterations": 1}


def _floats(obj, found=None):
    """The floating-point NumPy arrays a variant's call reaches through closures, ``functools.partial`` and lists."""
    found = [] if found is None else found
    if isinstance(obj, np.ndarray) and obj.dtype.kind == "f":
        found.append(obj)
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            _floats(cell.cell_contents, found)
    elif isinstance(obj, functools.partial):
        _floats([obj.func, *obj.args], found)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _floats(item, found)
    return found


def _bench_module():
    from mpidist._tools import bench  # imports mpi4py.MPI: a one-rank world in this process

    return bench


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 1000])
def test_uneven_splits_add_up_and_differ_between_ranks(rows, size):
    uneven_splits = _bench_module().uneven_splits
    splits = [uneven_splits(rows, rank, size) for rank in range(size)]
    assert all(len(s) == size and sum(s) == rows and min(s) >= 0 for s in splits)
    if size > 1 and rows >= 3 * size:
        assert all(len(set(s)) > 1 for s in splits)  # no rank splits evenly
        assert len({tuple(s) for s in splits}) == size  # and each its own way
    assert uneven_splits(300, 0, 2) == [100, 200] and uneven_splits(300, 1, 2) == [200, 100]


def test_the_report_gives_alltoall_and_bfloat16_times_and_ratios_but_no_verdict(tmp_path):
    results = {
        "alltoall": {
            "1048576 uneven": {"raw": _timed(2e-4, 2e-4), "mpidist": _timed(2.4e-4, 2.0e-4), "bytes": 1 << 20},
            "8 even": {
                "raw": _timed(2e-6, 2e-6),
                "mpidist": _timed(4e-6, 6e-6),
                "mpidist_nocheck": _timed(3e-6, 3e-6),
                "bytes": 8,
            },
            "1048576 even": {"raw": _timed(1e-4, 1e-4), "mpidist": _timed(1.2e-4, 1.0e-4), "bytes": 1 << 20},
        },
        "bfloat16": {
            "1024": {"raw_float32": _timed(1e-6, 1e-6), "float32": _timed(2e-6, 2e-6), "bfloat16": _timed(3e-6, 5e-6)}
        },
    }
    write_reports(META, results, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith(("| 8 B", "| 1 MiB"))]
    assert lines == [  # by size, even splits first
        "| 8 B | even | 2.0 us | 6.0 us | 3.00x | 2.50x (2.00-3.00, 2 rounds) | 3.0 us | 1.50x |",
        "| 1 MiB | even | 100.0 us | 120.0 us | 1.20x | 1.10x (1.00-1.20, 2 rounds) | - | - |",
        "| 1 MiB | uneven | 200.0 us | 240.0 us | 1.20x | 1.10x (1.00-1.20, 2 rounds) | - | - |",
    ]
    assert "the counts by `Alltoall` and then the rows by `Alltoallv`" in text
    assert "| 256 | 1 KiB | 1.0 us | 2.0 us | 5.0 us | 2.50x | 2.00x (1.50-2.50, 2 rounds) | 2.00x |" in text
    assert "goal" not in text.lower()
    write_reports(META, {"bfloat16": {"skipped": {"reason": "ml_dtypes is not installed"}}}, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert "## bfloat16 allreduce beside float32\n\nNot measured: ml_dtypes is not installed." in text
    assert "Alltoall" not in text


def test_every_alltoall_and_bfloat16_variant_writes_its_input_before_every_call():
    bench_module = _bench_module()
    bench = bench_module.Bench(repeats=1, torch_dist=None)
    strategies = bench_module.make_strategies()
    variants = {}
    for nbytes in (8, 4096, 1 << 17):  # with and without the check-off variant
        for even in (True, False):
            made, sent = bench_module.alltoall_variants(bench, strategies, nbytes, even)
            assert sent == max(1, nbytes // 4) * 4  # one rank: every size splits evenly
            assert set(made) == {"raw", "mpidist"} | ({"mpidist_nocheck"} if nbytes <= 64 * 1024 else set())
            variants.update({f"alltoall {nbytes} {even} {name}": v for name, v in made.items()})
    made = bench_module.bfloat16_variants(bench, strategies["check"], 4096, np.float16)  # any 16-bit float
    variants.update({f"bfloat16 {name}": v for name, v in made.items()})
    for name, variant in variants.items():
        before = bench.gradients.writes
        bench.sample(variant, 3)
        assert bench.gradients.writes - before == 3, name  # a write before each of the 3 calls
    for name, variant in variants.items():  # what each call sends was just written: no never-written zeros
        variant.write()
        sent = _floats(variant.call)
        assert sent, name
        assert all(np.count_nonzero(x) == x.size for x in sent), name
    for s in strategies.values():
        s.free()
    bench.comm.Free()


def test_bench_runs_the_alltoall_and_bfloat16_cases_under_mpiexec(tmp_path):
    out = tmp_path / "results"
    argv = [sys.executable, "-m", "mpidist", "bench", "--out", str(out), "--cases", "alltoall,bfloat16"]
    result = run_mpi(2, [*argv, "--max-bytes", "1024", "--repeats", "1", "--no-torch"], timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    run = json.loads((out / "results.json").read_text())
    assert set(run["results"]["alltoall"]) == {"8 even", "8 uneven", "1024 even", "1024 uneven"}
    for entry in run["results"]["alltoall"].values():
        assert {"raw", "mpidist", "mpidist_nocheck"} <= set(entry) and len(entry["probes"]) == 2
    half = run["results"]["bfloat16"]
    assert set(half) == {"skipped"} or set(half) == {"1024"}
    report = (out / "results.md").read_text()
    assert "## Alltoall (float32 rows" in report and "| 1 KiB | uneven |" in report
    assert "## bfloat16 allreduce beside float32" in report
