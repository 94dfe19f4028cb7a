"""``python -m mpidist bench``: its reports state times and ratios; the goals live in ``benchmarks/goals.py``.

Serial tests: the Markdown report and the goals' verdicts on made-up results; the command
itself under a real ``mpiexec`` (``tests/mpirun.py``) with its smallest settings.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from mpidist._tools.bench_report import median, placements, write_reports
from mpirun import run_mpi

TIMEOUT = 120
GOALS_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "goals.py"


def _goals():
    spec = importlib.util.spec_from_file_location("bench_goals", GOALS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(seconds):
    return {"median_s": seconds, "samples_s": [seconds], "iterations": 1}


META = {"ranks": 2, "mpi": "Open MPI v5.0.11", "python": "3.11.7", "numpy": "2.0", "cpus": 2, "machine": "x86_64",
        "date": "2026-01-01 00:00:00", "seconds": 1.0, "repeats": 1, "pipeline_bytes": 2 << 20,
        "fusion_bytes": 64 << 10, "torch": None}
RESULTS = {
    "sweep": {"4": {"raw": _timed(1e-6), "mpidist": _timed(8e-6)},
              str(1 << 20): {"raw": _timed(1e-4), "mpidist": _timed(1.05e-4), "gloo": _timed(4e-4)}},
    "update": {"8": {"raw_allreduce": _timed(1e-6), "hand_loop": _timed(3e-6), "mpidist": _timed(9e-6),
                     "mpidist_batch_update": _timed(1e-5), "mpidist_in_place": _timed(1e-5),
                     "mpidist_nocheck": _timed(6e-6), "peak_extra_bytes": 0, "pipeline_bytes": 2 << 20},
               str(64 << 20): {"raw_allreduce": _timed(0.02), "hand_loop": _timed(0.03), "mpidist": _timed(0.018),
                               "mpidist_batch_update": _timed(0.024), "mpidist_in_place": _timed(0.017),
                               "mpidist_nocheck": _timed(0.018), "peak_extra_bytes": 0, "pipeline_bytes": 2 << 20}},
    "memory": {str(256 << 20): {"copy": _timed(0.05), "add": _timed(0.1), "copy_GBps": 10.0, "add_GBps": 8.0}},
}


def test_the_report_gives_times_and_ratios_but_no_verdict(tmp_path):
    paths = write_reports(META, RESULTS, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert paths[0] == str(tmp_path / "results.md")
    assert "| 4 B | 1.0 us | 8.0 us | 8.00x |" in text and "| 1 MiB | 100.0 us | 105.0 us | 1.05x |" in text
    # 64 MiB: 0.6x the hand loop; the floor is 12 bytes per element at 8 GB/s: 25.2 ms
    assert "| 64 MiB | 20.00 ms | 30.00 ms | 18.00 ms | 24.00 ms | 17.00 ms | 18.00 ms | - | 0.60x | 0.80x | " \
           "25.17 ms | 0.72x |" in text
    assert "copy 10.0 GB/s, add 8.0 GB/s" in text
    assert "goal" not in text.lower() and "| met |" not in text


def test_the_goals_script_judges_each_measured_goal():
    rows = {goal: (reached, met) for goal, reached, met in _goals().verdicts(RESULTS)}
    assert rows["8 B mirrored update (two float32), default safety settings, <= 3x the hand loop"] == ("3.0x", True)
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
    probes = [[8e-4, 1e-4], [8e-4, 1e-4], [2.6e-3, 1e-4], [2.6e-3, 1e-4], [1.1e-3, 1e-4], [8e-4, 1e-4],
              [7e-4, 1e-4], [8e-4, 1e-4]]
    hand = [1.0, 9.0, 9.0, 9.0, 1.0, 1.0, 1.0]
    fused = [0.5, 9.5, 9.9, 9.9, 0.6, 0.5, 0.7]
    results = {"update": {str(16 << 20): {"hand_loop": _rounds(hand), "mpidist": _rounds(fused),
                                          "mpidist_batch_update": _rounds(fused), "probes": probes,
                                          "peak_extra_bytes": 0, "pipeline_bytes": 2 << 20}},
               "memory": {"8": {"copy": _timed(1.0), "add": _timed(1.0), "copy_GBps": 1.0, "add_GBps": 1.0}}}
    placements(results)
    entry = results["update"][str(16 << 20)]
    assert entry["rounds"] == ["shared", "mixed", "split", "mixed", "shared", "shared", "shared"]
    assert median(entry, "hand_loop", shared=True) == 1.0 and median(entry, "mpidist", shared=True) == 0.55
    assert median(entry, "mpidist") == 0.7  # all rounds
    goals = _goals()
    goal = "16 MiB mirrored MEAN update, `assign_add`, <= 0.7x the hand loop"
    assert dict((g, (r, m)) for g, r, m in goals.verdicts(results))[goal] == ("0.70x", True)
    assert dict((g, (r, m)) for g, r, m in goals.verdicts(results, shared=True))[goal] == ("0.55x", True)
    entry["probes"] = [[8e-4, 1e-4]] * 3 + [[2.6e-3, 1e-4]] * 5  # two shared rounds: too few
    placements(results)
    assert median(entry, "mpidist", shared=True) is None
    assert dict((g, (r, m)) for g, r, m in goals.verdicts(results, shared=True))[goal] == ("-", None)
    write_reports(META, results, str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert "## Placement of the ranks" in text and "800.0 us to 2.60 ms, 8.0 to 26.0 copies" in text
    assert "sharing a cache (both probes at most 12 copies): 2; not sharing one (both at least 15): 4; " \
           "changing: 1" in text and f"Fewer than 3 shared rounds: update {16 << 20}." in text
    assert "taking turns" not in text  # 2 ranks, 2 CPUs
    write_reports(dict(META, ranks=3), results, str(tmp_path))
    assert "More ranks (3) than this node has CPUs (2): the probes also measure the ranks taking turns" in \
        (tmp_path / "results.md").read_text()


def test_bench_under_mpiexec_and_the_goals_of_its_results(tmp_path, capsys):
    out = tmp_path / "results"
    result = run_mpi(2, [sys.executable, "-m", "mpidist", "bench", "--out", str(out), "--cases", "sweep,update",
                         "--max-bytes", "16", "--repeats", "1", "--no-torch"], timeout=TIMEOUT)
    assert result.returncode == 0, result.describe()
    run = json.loads((out / "results.json").read_text())
    assert run["meta"]["ranks"] == 2 and set(run["results"]) == {"sweep", "update"}
    for entry in (e for case in run["results"].values() for e in case.values()):  # a probe around each round
        assert len(entry["probes"]) == 2 and all(a > 0 and c > 0 for a, c in entry["probes"])
        assert len(entry["rounds"]) == 1
    assert "## Allreduce sweep" in (out / "results.md").read_text()
    assert _goals().main([str(out / "results.json")]) == 0
    printed = capsys.readouterr().out
    assert "| goal | all rounds | met | rounds with the ranks sharing a cache | met |" in printed
    assert "| 8 B mirrored update (two float32), default safety settings, <= 3x the hand loop |" in printed
