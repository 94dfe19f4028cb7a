"""``python -m mpidist bench``: its reports state times and ratios; the goals live in ``benchmarks/goals.py``.

Serial tests: the Markdown report and the goals' verdicts on made-up results; the inputs of the
cases as a training step leaves them (gradients written before every call, no never-written
memory), in a one-rank world; the command itself, and ``benchmarks/user_script.py`` next to it,
under a real ``mpiexec`` (``tests/helpers/mpirun.py``) with their smallest settings.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from mpidist._tools.bench_report import median, piece_bytes, placements, write_reports
from mpirun import run_mpi
from paths import REPO

TIMEOUT = 120
GOALS_SCRIPT = REPO / "benchmarks" / "goals.py"
USER_SCRIPT = REPO / "benchmarks" / "user_script.py"
INPUTS = "written before each call, each call timed alone"  # the meta entry of results.json on this basis
TINY_SHAPES = [(4, 3, 3, 3), (4,), (4,), (1000, 20), (1000,)]  # ResNet-like: convolution, batch norm, classifier


def _goals():
    spec = importlib.util.spec_from_file_location("bench_goals", GOALS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(seconds):
    return {"median_s": seconds, "samples_s": [seconds], "iterations": 1}


META = {
    "ranks": 2,
    "mpi": "Open MPI v5.0.11",
    "python": "3.11.7",
    "numpy": "2.0",
    "cpus": 2,
    "machine": "x86_64",
    "date": "2026-01-01 00:00:00",
    "seconds": 1.0,
    "repeats": 1,
    "piece_bytes": 2 << 20,
    "fusion_bytes": 64 << 10,
    "torch": None,
}
RESULTS = {
    "sweep": {
        "4": {"raw": _timed(1e-6), "mpidist": _timed(8e-6)},
        str(1 << 20): {"raw": _timed(1e-4), "mpidist": _timed(1.05e-4), "gloo": _timed(4e-4)},
    },
    "update": {
        "8": {
            "raw_allreduce": _timed(1e-6),
            "hand_loop": _timed(3e-6),
            "mpidist": _timed(9e-6),
            "mpidist_batch_update": _timed(1e-5),
            "mpidist_in_place": _timed(1e-5),
            "mpidist_nocheck": _timed(6e-6),
            "peak_extra_bytes": 0,
            "piece_bytes": 2 << 20,
        },
        str(64 << 20): {
            "raw_allreduce": _timed(0.02),
            "hand_loop": _timed(0.03),
            "mpidist": _timed(0.018),
            "mpidist_batch_update": _timed(0.024),
            "mpidist_in_place": _timed(0.017),
            "mpidist_nocheck": _timed(0.018),
            "peak_extra_bytes": 0,
            "piece_bytes": 2 << 20,
        },
    },
    "memory": {str(256 << 20): {"copy": _timed(0.05), "add": _timed(0.1), "copy_GBps": 10.0, "add_GBps": 8.0}},
    "compression": {str(64 << 20): {"exact": _timed(0.5), "fp16": _timed(0.3), "bf16": _timed(0.25)}},
}


def test_the_report_gives_times_and_ratios_but_no_verdict(tmp_path):
    paths = write_reports(META, RESULTS, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert paths[0] == str(tmp_path / "results.md")
    assert "| 4 B | 1.0 us | 8.0 us | 8.00x |" in text and "| 1 MiB | 100.0 us | 105.0 us | 1.05x |" in text
    # 64 MiB: 0.6x the hand loop; the floor is 12 bytes per element at 8 GB/s: 25.2 ms
    assert (
        "| 64 MiB | 20.00 ms | 30.00 ms | 18.00 ms | 24.00 ms | 17.00 ms | 18.00 ms | - | 0.60x | 0.80x | "
        "25.17 ms | 0.72x |" in text
    )
    assert "copy 10.0 GB/s, add 8.0 GB/s" in text
    assert (
        "| 64 MiB | 500.00 ms | 300.00 ms | 250.00 ms | 0.60x (0.60-0.60, 1 rounds) | 0.50x (0.50-0.50, 1 rounds) |"
        in text
    )
    assert "goal" not in text.lower() and "| met |" not in text


def test_the_goals_script_judges_each_measured_goal():
    rows = {goal: (reached, met) for goal, reached, met in _goals().verdicts(RESULTS)}
    assert rows["8 B mirrored update (two float32), default safety settings, <= 2.5x the hand loop"] == ("3.0x", False)
    assert not any("one float64" in goal for goal in rows)  # no safety case in this run
    assert rows["64 MiB mirrored MEAN update, `assign_add`, <= 0.7x the hand loop"] == ("0.60x", True)
    assert rows["64 MiB mirrored MEAN update, `batch_update`, <= 0.7x the hand loop"] == ("0.80x", False)
    assert rows["at least 3x faster than torch gloo at every size"] == ("worst 3.8x at 1 MiB", True)
    assert not any("ResNet-50" in goal for goal in rows)  # not measured: no row
    assert not any(goal.startswith("8 B mirrored MEAN update") for goal in rows)  # below 1 MiB: no size goal


def _rounds(samples):
    """A variant's entry with one sample per round (median of all rounds as the benchmark takes it)."""
    return {"median_s": sorted(samples)[len(samples) // 2], "samples_s": samples, "iterations": 1}


def test_rounds_are_labelled_by_the_probes_around_them(tmp_path):
    # 7 rounds; the probe's allreduce takes 8 local copies when the ranks share a cache, 26 when they do not
    probes = [
        [8e-4, 1e-4],
        [8e-4, 1e-4],
        [2.6e-3, 1e-4],
        [2.6e-3, 1e-4],
        [1.1e-3, 1e-4],
        [8e-4, 1e-4],
        [7e-4, 1e-4],
        [8e-4, 1e-4],
    ]
    hand = [1.0, 9.0, 9.0, 9.0, 1.0, 1.0, 1.0]
    fused = [0.5, 9.5, 9.9, 9.9, 0.6, 0.5, 0.7]
    results = {
        "update": {
            str(16 << 20): {
                "hand_loop": _rounds(hand),
                "mpidist": _rounds(fused),
                "mpidist_batch_update": _rounds(fused),
                "probes": probes,
                "peak_extra_bytes": 0,
                "piece_bytes": 2 << 20,
            }
        },
        "memory": {"8": {"copy": _timed(1.0), "add": _timed(1.0), "copy_GBps": 1.0, "add_GBps": 1.0}},
    }
    placements(results)
    entry = results["update"][str(16 << 20)]
    assert entry["rounds"] == ["shared", "mixed", "split", "mixed", "shared", "shared", "shared"]
    assert median(entry, "hand_loop", shared=True) == 1.0 and median(entry, "mpidist", shared=True) == 0.55
    assert median(entry, "mpidist") == 0.7  # all rounds
    goals = _goals()
    goal = "16 MiB mirrored MEAN update, `assign_add`, <= 0.7x the hand loop"
    assert {g: (r, m) for g, r, m in goals.verdicts(results)}[goal] == ("0.70x", True)
    assert {g: (r, m) for g, r, m in goals.verdicts(results, shared=True)}[goal] == ("0.55x", True)
    entry["probes"] = [[8e-4, 1e-4]] * 3 + [[2.6e-3, 1e-4]] * 5  # two shared rounds: too few
    placements(results)
    assert median(entry, "mpidist", shared=True) is None
    assert {g: (r, m) for g, r, m in goals.verdicts(results, shared=True)}[goal] == ("-", None)
    write_reports(META, results, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert "## Placement of the ranks" in text and "800.0 us to 2.60 ms, 8.0 to 26.0 copies" in text
    assert (
        "sharing a cache (both probes at most 12 copies): 2; not sharing one (both at least 15): 4; changing: 1" in text
        and f"Fewer than 3 shared rounds: update {16 << 20}." in text
    )
    assert "taking turns" not in text  # 2 ranks, 2 CPUs
    write_reports(dict(META, ranks=3), results, str(tmp_path))
    assert (
        "More ranks (3) than this node has CPUs (2): the probes also measure the ranks taking turns"
        in (tmp_path / "results.md").read_text()
    )


def test_bench_under_mpiexec_and_the_goals_of_its_results(tmp_path, capsys):
    out = tmp_path / "results"
    result = run_mpi(
        2,
        [
            sys.executable,
            "-m",
            "mpidist",
            "bench",
            "--out",
            str(out),
            "--cases",
            "sweep,update",
            "--max-bytes",
            "16",
            "--repeats",
            "1",
            "--no-torch",
        ],
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.describe()
    run = json.loads((out / "results.json").read_text())
    assert run["meta"]["ranks"] == 2 and set(run["results"]) == {"sweep", "update"}
    assert run["meta"]["inputs"] == INPUTS
    for entry in (e for case in run["results"].values() for e in case.values()):  # a probe around each round
        assert len(entry["probes"]) == 2 and all(a > 0 and c > 0 for a, c in entry["probes"])
        assert len(entry["rounds"]) == 1
    report = (out / "results.md").read_text()
    assert "## Allreduce sweep" in report and f"Inputs: {INPUTS} (gradients written with new values" in report
    assert _goals().main([str(out / "results.json")]) == 0
    printed = capsys.readouterr().out
    assert "| goal | all rounds | met | rounds with the ranks sharing a cache | met |" in printed
    assert "| 8 B mirrored update (two float32), default safety settings, <= 2.5x the hand loop |" in printed
    assert f"inputs: {INPUTS}" in printed


def _bench_module():
    from mpidist._tools import bench  # imports mpi4py.MPI: a one-rank world in this process

    return bench


def _reachable(obj, found=None):
    """The NumPy arrays and variables that a variant's functions reach through closures and containers."""
    from mpidist import DistributedVariable

    found = [] if found is None else found
    if isinstance(obj, (np.ndarray, DistributedVariable)):
        found.append(obj)
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            _reachable(cell.cell_contents, found)
    elif isinstance(obj, functools.partial):
        _reachable([obj.func, *obj.args, *obj.keywords.values()], found)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _reachable(item, found)
    return found


def _variants_of_the_cases(bench_module, bench):
    strategies = bench_module.make_strategies()
    variants = {f"update {name}": v for name, v in bench_module.update_variants(bench, strategies, 4096).items()}
    variants.update(
        {f"resnet50 {name}": v for name, v in bench_module.resnet_variants(bench, strategies, TINY_SHAPES).items()}
    )
    for wire in ("fp16", "bf16"):
        strategies[wire] = bench_module.MPIStrategy(device="cpu", compression=wire, abort_on_error=False)
    compressed = {"exact": strategies["check"], "fp16": strategies["fp16"], "bf16": strategies["bf16"]}
    variants.update(
        {f"compression {name}": v for name, v in bench_module.compression_variants(bench, compressed, 4096).items()}
    )
    return variants, strategies


def test_gradients_are_written_before_every_call_and_only_the_call_is_timed():
    bench_module = _bench_module()
    bench = bench_module.Bench(repeats=3, torch_dist=None)
    grad = np.empty(4, np.float32)
    seen, events = [], []
    write = bench.gradients.writer([grad])

    def call():
        events.append("call")
        seen.append(grad.copy())

    def slow_write():
        events.append("write")
        write()

    times = bench.compare("test", "4", {"a": bench_module.Variant(call, slow_write)})
    calls = bench.results["test"]["4"]["a"]["iterations"]
    assert events == ["write", "call"] * (2 + 3 * calls)  # two warm-up samples, then 3 samples
    assert all(s.all() for s in seen)  # written, not zero
    assert all(not np.array_equal(a, b) for a, b in zip(seen, seen[1:]))  # new values before every call
    assert times["a"] > 0
    bench.comm.Free()


def test_every_variant_of_the_update_and_resnet_cases_writes_its_gradients_and_reads_real_memory():
    bench_module = _bench_module()
    bench = bench_module.Bench(repeats=1, torch_dist=None)
    variants, strategies = _variants_of_the_cases(bench_module, bench)
    writes = []
    for name, variant in variants.items():
        variant.write()
        before = bench.gradients.writes
        bench.sample(variant, 3)
        writes.append((name, bench.gradients.writes - before))
    assert writes == [(name, 3) for name in variants]  # one write before each of the 3 calls, in every variant
    for name, variant in variants.items():
        variant.write()
        reached = _reachable(variant.call)
        assert reached, name
        for x in reached:  # gradients just written, weights written when made: nothing is all zeros
            value = x.numpy() if not isinstance(x, np.ndarray) else x
            assert np.count_nonzero(value) == value.size, f"{name}: an array of zeros, never written"
    for s in strategies.values():
        s.free()
    bench.comm.Free()


def test_the_user_script_and_the_bench_time_the_same_calls_under_mpiexec(tmp_path):
    saved = tmp_path / "results.json"
    resnet = {
        name: _timed(t)
        for name, t in (
            ("raw_per_array", 0.02),
            ("hand_loop_per_array", 0.04),
            ("mpidist_batch_update_flat_in_place", 0.03),
            ("mpidist_reduce_list_out", 0.022),
            ("mpidist_all_reduce_out", 0.023),
            ("mpidist_reduce_list_in_place", 0.02),
        )
    }
    update = {"4096": {"hand_loop": _timed(3e-5), "mpidist": _timed(1.8e-5)}, "8": RESULTS["update"]["8"]}
    saved.write_text(
        json.dumps(
            {"meta": dict(META, inputs=INPUTS), "results": {"update": update, "resnet50": {"161 arrays": resnet}}}
        )
    )
    result = run_mpi(
        2,
        [
            sys.executable,
            str(USER_SCRIPT),
            "--samples",
            "2",
            "--update-bytes",
            "4096",
            "--shrink",
            "512",
            "--results",
            str(saved),
        ],
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.describe()
    out = result.stdout
    assert f"saved benchmark run: {saved}" in out and "OLD BASIS" not in out
    number = r"\d+\.\d+ (?:us|ms)"
    for case, call in (
        ("update", "mpidist"),
        ("update", "hand_loop"),
        ("resnet_update", "hand_loop"),
        ("resnet_update", "batch_update_flat_in_place"),
        ("resnet_reduce", "reduce_out"),
        ("resnet_reduce", "all_reduce_out"),
        ("resnet_reduce", "reduce_in_place"),
        ("resnet_reduce", "raw_per_array"),
        ("small", "mpidist"),
        ("small", "hand_loop"),
    ):
        # the script's time and the bench's, both measured in this run, and their ratio
        assert re.search(rf"\| {case} \| {call} \| {number} \| {number} \| \d+\.\d+x \|", out), (case, call, out)
    # the saved run's 4 KiB update (18 us against 30 us: 0.60x) and 8-byte update (9 us against 3 us);
    # its resnet numbers are of other shapes than --shrink's: not compared
    assert re.search(rf"\| update \| mpidist \| {number} \| {number} \| [\d.]+x \| 18.0 us \|", out), out
    ratios = r"\| [\d.]+x \| [\d.]+x \| - \| - \|"  # script and bench over all rounds; two rounds: none shared
    assert re.search(rf"\| update \| mpidist \| hand_loop {ratios} 0.60x \| - \|", out), out
    assert re.search(rf"\| small \| mpidist \| hand_loop {ratios} 3.00x \| - \|", out), out
    assert re.search(rf"\| resnet_reduce \| reduce_out \| raw_per_array {ratios} - \| - \|", out), out
    assert re.search(r"placement of the ranks \(.*\): \d rounds sharing a cache, \d not, \d changing", out), out


def test_results_of_earlier_versions_name_the_piece_size_pipeline_bytes():
    assert piece_bytes({"piece_bytes": 8 << 20}) == 8 << 20
    assert piece_bytes({"pipeline_bytes": 4 << 20}) == 4 << 20  # results.json of 0.2


def test_the_fault_tolerance_cost_script_reports_both_modes_and_the_copy_under_mpiexec():
    """``benchmarks/fault_tolerance_cost.py`` at 2 ranks, tiny: a line per size with both modes and one copy."""
    script = REPO / "benchmarks" / "fault_tolerance_cost.py"
    result = run_mpi(2, [sys.executable, str(script), "--rounds", "3", "--sizes", "8,65536"], timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    for size in (8, 65536):
        line = re.search(rf"^{size} B mirrored MEAN update, 2 ranks, 3 rounds of \d+ calls: (.*)$", result.stdout, re.M)
        assert line is not None, result.describe()
        assert re.search(r"off [\d.]+ us, on [\d.]+ us, one copy [\d.]+ us; .*on / off median [\d.]+x", line[1])
    assert "load average" in result.stdout


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--repeats", "0"], "--repeats: expected a whole number of at least 1, got 0"),
        (["--max-bytes", "-1"], "--max-bytes: expected a whole number of at least 1, got -1"),
        (["--cases", "safety,nonsense"], "--cases: unknown case 'nonsense'; choose from sweep,"),
        (["--cases", ","], "--cases: it names no case"),
    ],
)
def test_bad_options_are_one_line_usage_errors(args, complaint):
    # Before: --repeats 0 and --max-bytes -1 ended in tracebacks (after minutes of measuring for --repeats),
    # and an unknown case ran nothing and exited 0.
    result = subprocess.run(
        [sys.executable, "-m", "mpidist", "bench", *args], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 2 and complaint in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_out_directory_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [sys.executable, "-m", "mpidist", "bench", "--no-torch", "--cases", "safety", "--out", str(blocker / "out")]
    result = run_mpi(2, argv, timeout=TIMEOUT)
    assert result.returncode == 1, result.describe()
    assert result.stderr.count(f"mpidist bench: error: cannot write the results to --out {blocker / 'out'}") == 1
    assert "Traceback" not in result.stderr and "[bench]" not in result.stdout, result.describe()
