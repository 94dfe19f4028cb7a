"""The goals set for mpidist's collectives, and a verdict for each from one benchmark run.

    mpiexec -n 2 python -m mpidist bench --out bench-results
    python benchmarks/goals.py bench-results/results.json

``python -m mpidist bench`` reports times and ratios against the baselines of
the same run; this script holds the targets those ratios are compared with and
prints one Markdown row per goal that the run measured: the goal, what the run
reached, and whether that meets it, over all rounds of samples and over the
rounds in which the ranks shared a cache (the benchmark's probes tell; "-" with
fewer than three such rounds). ``docs/benchmarks.md`` lists the goals of the
other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, Optional

from mpidist._tools.bench_report import median, piece_bytes
from mpidist._units import human_size

_MIB = 1 << 20

Verdict = tuple[str, str, Optional[bool]]  # (goal, what was reached, met? None: not enough rounds)


def _ratio(entry: dict[str, Any], name: str, base: str, shared: bool) -> Optional[float]:
    a, b = median(entry, name, shared), median(entry, base, shared)
    return None if a is None or not b else a / b


def _at_most(goal: str, r: Optional[float], limit: float, digits: int = 2) -> Verdict:
    return (goal, "-", None) if r is None else (goal, f"{r:.{digits}f}x", r <= limit)


def _update(results: dict[str, Any], shared: bool) -> list[Verdict]:
    """A mirrored MEAN update against the hand loop: <= 0.7x from 16 MiB up, <= 1.05x from 1 MiB to 16 MiB."""
    rows = []
    for key, entry in sorted(results.get("update", {}).items(), key=lambda kv: int(kv[0])):
        nbytes = int(key)
        if nbytes < _MIB:
            continue
        limit = 0.7 if nbytes >= 16 * _MIB else 1.05
        for name, how in (("mpidist", "`assign_add`"), ("mpidist_batch_update", "`batch_update`")):
            if median(entry, name):
                rows.append(
                    _at_most(
                        f"{human_size(nbytes)} mirrored MEAN update, {how}, <= {limit}x the hand loop",
                        _ratio(entry, name, "hand_loop", shared),
                        limit,
                    )
                )
    return rows


def _resnet(results: dict[str, Any], shared: bool) -> list[Verdict]:
    """ResNet-50 shapes: ``batch_update`` <= 0.8x the hand loop per array; the SUM of the list <= 1.1x one raw
    in-place ``Allreduce`` per array into ``out=`` arrays, <= 1.0x in place."""
    resnet = results.get("resnet50", {}).get("161 arrays")
    if not resnet:
        return []
    rows = []
    for name, how in (
        ("mpidist_batch_update_flat", "flat variables"),
        ("mpidist_batch_update_flat_in_place", "flat variables, `in_place=True`"),
        ("mpidist_batch_update", "ordinary arrays"),
    ):
        if median(resnet, name):
            rows.append(
                _at_most(
                    f"ResNet-50 `batch_update` ({how}) <= 0.8x the hand loop per array",
                    _ratio(resnet, name, "hand_loop_per_array", shared),
                    0.8,
                )
            )
    for name, how, limit in (
        ("mpidist_reduce_list_out", "`strategy.reduce` of the list with `out=`", 1.1),
        ("mpidist_all_reduce_out", "`ReplicaContext.all_reduce` of the list with `out=`", 1.1),
        ("mpidist_reduce_list_in_place", "`strategy.reduce` of the list in place (`out=` the list)", 1.0),
    ):
        if median(resnet, name):
            rows.append(
                _at_most(
                    f"ResNet-50 {how} <= {limit}x one raw in-place Allreduce per array",
                    _ratio(resnet, name, "raw_per_array", shared),
                    limit,
                )
            )
    return rows


def _small(results: dict[str, Any], shared: bool) -> list[Verdict]:
    """An 8-byte mirrored update with the default safety settings at most 2.5x the hand loop.

    Judged on each 8-byte update the run measured: ``safety`` (one float64)
    and ``update`` (two float32; NumPy's float32 operations on tiny arrays
    are faster, so its hand loop is).
    """
    rows = []
    for entry, name, what in (
        (results.get("safety", {}).get("update_8B"), "default", "one float64"),
        (results.get("update", {}).get("8"), "mpidist", "two float32"),
    ):
        if entry and median(entry, "hand_loop"):
            rows.append(
                _at_most(
                    f"8 B mirrored update ({what}), default safety settings, <= 2.5x the hand loop",
                    _ratio(entry, name, "hand_loop", shared),
                    2.5,
                    digits=1,
                )
            )
    return rows


def _sweep(results: dict[str, Any], shared: bool) -> list[Verdict]:
    """At least 3x faster than gloo at every size."""
    goal = "at least 3x faster than torch gloo at every size"
    gloo = [
        (int(k), _ratio(e, "gloo", "mpidist", shared)) for k, e in results.get("sweep", {}).items() if median(e, "gloo")
    ]
    if not gloo:
        return []
    if any(r is None for _, r in gloo):
        return [(goal, "-", None)]
    size, r = min(gloo, key=lambda kv: kv[1])
    return [(goal, f"worst {r:.1f}x at {human_size(size)}", r >= 3)]


def _memory(results: dict[str, Any], shared: bool) -> list[Verdict]:
    """A 256 MiB update allocates at most two pieces of the pipelined reduction (whatever the placement)."""
    entry = results.get("update", {}).get(str(256 * _MIB))
    if not entry:
        return []
    extra, limit = entry["peak_extra_bytes"], 2 * piece_bytes(entry)
    return [
        (
            "256 MiB update: peak memory grows by at most 2 pieces",
            f"{human_size(extra)} (2 pieces: {human_size(limit)})",
            extra <= limit,
        )
    ]


GOALS = (_update, _resnet, _small, _sweep, _memory)


def verdicts(results: dict[str, Any], shared: bool = False) -> list[Verdict]:
    """Every goal that ``results`` (the ``results`` object of ``results.json``) measured, with its verdict.

    Over all rounds of samples, or with ``shared`` over the rounds in which
    the ranks shared a cache.
    """
    return [row for goal in GOALS for row in goal(results, shared)]


def _met(met: Optional[bool]) -> str:
    return "-" if met is None else "yes" if met else "no"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.json written by `python -m mpidist bench`")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        run = json.load(f)
    meta = run["meta"]
    print(f"{meta['ranks']} ranks, {meta['mpi']}, {meta['date']}")
    print(
        f"inputs: {meta['inputs']}\n"
        if meta.get("inputs")
        else "inputs: OLD BASIS, gradients never written (np.zeros, the kernel's zero page): re-measure\n"
    )
    print("| goal | all rounds | met | rounds with the ranks sharing a cache | met |\n|---|---|---|---|---|")
    for (goal, reached, met), (_, shared, met_shared) in zip(
        verdicts(run["results"]), verdicts(run["results"], shared=True)
    ):
        print(f"| {goal} | {reached} | {_met(met)} | {shared} | {_met(met_shared)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
