"""The goals set for mpidist's collectives, and a verdict for each from one benchmark run.

    mpiexec -n 2 python -m mpidist bench --out bench-results
    python benchmarks/goals.py bench-results/results.json

``python -m mpidist bench`` reports times and ratios against the baselines of
the same run; this script holds the targets those ratios are compared with and
prints one Markdown row per goal that the run measured: the goal, what the run
reached, and whether that meets it. ``docs/benchmarks.md`` lists the goals of
the other benchmarks.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from mpidist._tools.bench_report import median
from mpidist._units import human_size

_MIB = 1 << 20

Verdict = tuple[str, str, bool]  # (goal, what was reached, met?)


def _ratio(entry: dict[str, Any], name: str, base: str) -> float:
    return median(entry, name) / median(entry, base)


def _update(results: dict[str, Any]) -> list[Verdict]:
    """A large mirrored MEAN update at most 0.5x of one raw in-place Allreduce + divide."""
    update = results.get("update", {})
    rows = []
    for nbytes in (64 * _MIB, 256 * _MIB):
        for name, how in (("mpidist", "`assign_add`"), ("mpidist_in_place", "`batch_update(in_place=True)`")):
            if str(nbytes) in update:
                r = _ratio(update[str(nbytes)], name, "raw_allreduce_divide")
                rows.append((f"{human_size(nbytes)} mirrored MEAN update, {how}, <= 0.5x raw Allreduce(IN_PLACE) "
                             "+ divide", f"{r:.2f}x", r <= 0.5))
    return rows


def _resnet(results: dict[str, Any]) -> list[Verdict]:
    """The fused ResNet-50 update at most 0.5x of one raw Allreduce per array."""
    resnet = results.get("resnet50", {}).get("161 arrays")
    if not resnet:
        return []
    rows = []
    for name, how in (("mpidist_fused_flat", "flat"), ("mpidist_fused_flat_in_place", "flat, in place")):
        r = _ratio(resnet, name, "raw_per_array")
        rows.append((f"ResNet-50 fused update ({how}) <= 0.5x one raw Allreduce per array", f"{r:.2f}x", r <= 0.5))
    return rows


def _small(results: dict[str, Any]) -> list[Verdict]:
    """An 8-byte mirrored update close to one raw Allreduce, with the agreement check on and off."""
    entry = results.get("update", {}).get("8")
    if not entry:
        return []
    on, off = _ratio(entry, "mpidist", "raw_allreduce"), _ratio(entry, "mpidist_nocheck", "raw_allreduce")
    return [("8 B mirrored update, agreement check on, <= 2x one raw Allreduce", f"{on:.1f}x", on <= 2),
            ("8 B mirrored update, agreement check off, <= 1.2x one raw Allreduce", f"{off:.1f}x", off <= 1.2)]


def _sweep(results: dict[str, Any]) -> list[Verdict]:
    """At least 3x faster than gloo, and never more than 10% slower than raw mpi4py, at every size."""
    sweep = results.get("sweep", {})
    rows = []
    gloo = [(int(k), _ratio(e, "gloo", "mpidist")) for k, e in sweep.items() if median(e, "gloo")]
    if gloo:
        size, r = min(gloo, key=lambda kv: kv[1])
        rows.append(("at least 3x faster than torch gloo at every size", f"worst {r:.1f}x at {human_size(size)}",
                     r >= 3))
    if sweep:
        size, r = max(((int(k), _ratio(e, "mpidist", "raw")) for k, e in sweep.items()), key=lambda kv: kv[1])
        rows.append(("no size where mpidist is > 10% slower than raw mpi4py",
                     f"worst {r:.2f}x at {human_size(size)}", r <= 1.1))
    return rows


def _memory(results: dict[str, Any]) -> list[Verdict]:
    """A 256 MiB update allocates at most two pieces of the pipelined reduction."""
    entry = results.get("update", {}).get(str(256 * _MIB))
    if not entry:
        return []
    extra, limit = entry["peak_extra_bytes"], 2 * entry["pipeline_bytes"]
    return [("256 MiB update: peak memory grows by at most 2 pieces",
             f"{human_size(extra)} (2 pieces: {human_size(limit)})", extra <= limit)]


GOALS = (_update, _resnet, _small, _sweep, _memory)


def verdicts(results: dict[str, Any]) -> list[Verdict]:
    """Every goal that ``results`` (the ``results`` object of ``results.json``) measured, with its verdict."""
    return [row for goal in GOALS for row in goal(results)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.json written by `python -m mpidist bench`")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        run = json.load(f)
    rows = verdicts(run["results"])
    meta = run["meta"]
    print(f"{meta['ranks']} ranks, {meta['mpi']}, {meta['date']}\n")
    print("| goal | reached | met |\n|---|---|---|")
    for goal, reached, met in rows:
        print(f"| {goal} | {reached} | {'yes' if met else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
