"""The agreement's cost against the number of ranks: the ``scaling`` case and ``benchmarks/agreement_scaling.py``.

Serial tests: the tables from made-up runs; the library's counters refusing a variable it lacks;
the help texts; and the script itself, which starts ``mpiexec`` at 2 and 3 ranks (with Open MPI's
monitoring on) and writes the table, its counts checked against what any allreduce of the agreement
record must send. Counts, not timings: nothing here depends on the machine's speed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import sys

import pytest

from mpidist._tools.bench_report import scaling_tables
from mpirun import run_command
from paths import REPO

SCRIPT = REPO / "benchmarks" / "agreement_scaling.py"
RECORD = 408  # bytes of the agreement record: 51 float64
TIMEOUT = 300


def _script():
    spec = importlib.util.spec_from_file_location("agreement_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count(calls, messages=None, sent=None, received=None):
    return {
        "mpi_calls": calls,
        "mpi_calls_alike": True,
        "messages": messages,
        "bytes": sent,
        "received_bytes": received,
    }


def _entry(ranks, counted, timed):
    """A results entry of the scaling case: the agreement record as a binomial tree would send it (made up)."""
    n = ranks
    per_rank = [min(n - 1, 2)] + [1] * (n - 1)
    entry = {
        "counts": {
            "mpidist": _count(
                {"Start": 1.0},
                *((per_rank, [RECORD * m for m in per_rank], [RECORD * m for m in per_rank]) if counted else ()),
            ),
            "raw": _count({"Allreduce": 1.0}, *(([1.0] * n, [8.0] * n, [8.0] * n) if counted else ())),
        },
        "counted_by": "messages counted by the test" if counted else "messages not counted: the test",
        "counted_calls": 10,
    }
    if timed:
        entry["raw"] = {"median_s": 2e-6, "samples_s": [2e-6, 2e-6], "iterations": 1}
        entry["mpidist"] = {"median_s": 5e-6, "samples_s": [4e-6, 6e-6], "iterations": 1}
    else:
        entry["not_timed"] = f"{n} ranks on 1 core: timings would measure their turns"
    return entry


def test_the_tables_give_counts_per_rank_at_every_n_and_times_where_measured():
    runs = [
        ({"ranks": 4, "mpi": "Open MPI v5.0.11"}, {"scaling": {"update_8B": _entry(4, True, True)}}),
        ({"ranks": 2, "mpi": "MPICH Version: 5.0.2"}, {"scaling": {"barrier": _entry(2, False, False)}}),
        ({"ranks": 1, "mpi": "Open MPI v5.0.11"}, {"sweep": {}}),  # no scaling case: no rows
    ]
    text = "\n".join(scaling_tables(runs))
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows == [
        "| 2 | 1 | barrier | 1: Start | - | - | - | - | - |",  # fewest ranks first
        "| 4 | 2 | 8 B mirrored update | 1: Start | 1.25 / 2 | 510 / 816 | 816 | 1 / 1 | 8 / 8 |",
        "| 4 | 8 B mirrored update | 2.0 us | 5.0 us | 2.50x | 2.50x (2.00-3.00, 2 rounds) |",
    ]
    assert "- 4 ranks, Open MPI v5.0.11: messages counted by the test; MPI calls and messages per call over 10" in text
    assert "- 2 ranks, MPICH Version: 5.0.2: messages not counted: the test;" in text
    assert "not timed (2 ranks on 1 core" in text
    assert scaling_tables([runs[2]]) == []


def test_performance_variables_name_a_variable_the_library_lacks():
    from mpi4py import MPI

    from mpidist._comm.library import PerformanceVariables

    with pytest.raises(OSError, match="no performance variable mpidist_no_such_counter"):
        PerformanceVariables(["mpidist_no_such_counter"], MPI.COMM_WORLD)


def test_the_help_says_what_is_counted_and_how_to_run_it():
    from mpidist._tools.cli import build_parser

    for parse in (lambda: build_parser().parse_args(["bench", "--help"]), lambda: _script().main(["--help"])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            parse()
        text = " ".join(out.getvalue().split())
        for words in ("scaling", "OMPI_MCA_pml_monitoring_enable=1", "messages and bytes", "more ranks than cores"):
            assert words in text, (words, text)
        assert "-n 16" in text or "--ranks 2,4,8,16" in text, text


def test_the_script_counts_the_agreement_at_2_and_3_ranks(tmp_path):
    result = run_command(
        [sys.executable, SCRIPT, "--ranks", "2,3", "--repeats", "1", "--out", tmp_path], timeout=2 * TIMEOUT
    )
    assert result.returncode == 0, result.describe()
    table = (tmp_path / "scaling.md").read_text()
    assert table in result.stdout
    cores = len(os.sched_getaffinity(0))
    for n in (2, 3):
        run = json.loads((tmp_path / f"ranks-{n}" / "results.json").read_text())
        case = run["results"]["scaling"]
        assert run["meta"]["ranks"] == n and set(case) == {"update_8B", "allreduce_1MiB", "barrier"}
        steps = math.ceil(math.log2(n))
        for key, label, calls in (
            ("update_8B", "8 B mirrored update", "1: Start"),
            ("allreduce_1MiB", "1 MiB allreduce", "2: Iallreduce, Start"),  # with the deadline: nonblocking
            ("barrier", "barrier", "1: Start"),
        ):
            assert f"| {n} | {steps} | {label} | {calls} |" in table, (key, table)
            assert ("not_timed" in case[key]) == (n > cores), case[key]
            assert ("mpidist" in case[key]) == (n <= cores)  # the timed variant beside the counts
        update, allreduce, barrier = (case[k]["counts"]["mpidist"] for k in ("update_8B", "allreduce_1MiB", "barrier"))
        assert barrier["mpi_calls"] == update["mpi_calls"] == {"Start": 1.0}
        if not run["meta"]["mpi"].startswith("Open MPI"):
            assert barrier["messages"] is None and "messages not counted" in case["barrier"]["counted_by"]
            assert "| - | - | - | - | - |" in table
            continue
        assert "messages counted by Open MPI's monitoring" in case["barrier"]["counted_by"]
        # the barrier and the 8-byte update are the agreement alone: the same messages, the record's bytes
        for what in ("messages", "bytes", "received_bytes"):
            assert update[what] == barrier[what] and len(barrier[what]) == n, what
        assert sum(barrier["bytes"]) == sum(barrier["received_bytes"])
        # every rank must receive the others' part of the summed record; no algorithm sends more than a ring
        assert min(barrier["received_bytes"]) >= RECORD * (n - 1) / n
        assert 1 <= max(barrier["messages"]) <= 2 * (n - 1)
        # the 1 MiB allreduce: the agreement and then the data, at least (N-1)/N of it through every rank
        data = [a - b for a, b in zip(allreduce["bytes"], barrier["bytes"])]
        assert min(data) >= (1 << 20) * (n - 1) / n and min(allreduce["messages"]) > min(barrier["messages"])
        raw = case["update_8B"]["counts"]["raw"]
        assert raw["mpi_calls"] == {"Allreduce": 1.0} and min(raw["messages"]) >= 1 and sum(raw["bytes"]) >= 8 * n
