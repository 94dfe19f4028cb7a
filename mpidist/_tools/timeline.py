"""``python -m mpidist timeline DIR``: merge the ranks' timelines, align their clocks, name whom they waited for.

A job run with ``MPIDIST_TIMELINE=DIR`` (or ``MPIStrategy(timeline=DIR)``)
leaves one trace file per rank in ``DIR`` (:mod:`mpidist._comm.timeline`
describes them). This command reads them (also those of a killed job: a line
cut short is skipped), and

- aligns the ranks' clocks (below), then writes one Chrome-trace / Perfetto
  file with one process (track group) per rank: ``DIR/timeline.json``;
- prints a table: per rank, the time spent computing (outside mpidist's
  collectives), waiting in agreements (for the other ranks) and transferring
  data, and which rank arrived last at each collective, that is, which
  rank the others waited for;
- draws each rank's wait per step (``DIR/timeline.png``, with matplotlib), so
  that a rank that makes the others wait stands out: its own wait is the
  lowest.

Clock alignment. Ranks on different machines read different clocks. Every
collective begins with the agreement, one allreduce, which completes on all
ranks at nearly the same moment, and cannot complete on any rank before every
rank has started it. For each rank ``r`` and the reference rank (the lowest),
over the collectives both recorded, the offset of ``r``'s clock is the median
of the differences of the agreements' end times, ``end_r - end_ref``; the
command prints it with half the interquartile range of those differences (how
tightly they agree: a few microseconds on one machine). Causality bounds it as
well: the true offset lies between ``max(start_r - end_ref)`` and
``min(end_r - start_ref)`` over all agreements, an interval that the command
prints too and that the estimate is kept in. It is tight on both sides when
each of the two ranks is sometimes the last to arrive; when one rank always
arrives last (a straggler) one side stays wide, and the median pins the offset.
Where the clocks run at slightly different rates (different machines, long
runs), an offset that drifts linearly is fitted as well, and kept when it fits
the end times more closely. A clock that jumps breaks the model: causality then
contradicts the estimate, and the command says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from mpidist._comm.timeline import FILE_PATTERN
from mpidist._units import human_time

__all__ = [
    "DESCRIPTION",
    "Offset",
    "RankTrace",
    "Summary",
    "add_arguments",
    "agreements",
    "align",
    "draw",
    "format_table",
    "merge",
    "read_directory",
    "read_trace",
    "run",
    "step_waits",
    "summarize",
]

DESCRIPTION = (
    "Merge the per-rank timeline files that a job run with MPIDIST_TIMELINE=DIR (or "
    "MPIStrategy(timeline=DIR)) wrote into DIR: align the ranks' clocks from the collectives' own "
    "timing, write one Chrome-trace / Perfetto file with a track per rank (open it at "
    "https://ui.perfetto.dev or chrome://tracing), print per rank the time computing, waiting for the "
    "other ranks and transferring data, and which rank the others waited for most, and draw each "
    "rank's wait per step (needs matplotlib: pip install 'mpidist[timeline]'). Reads files only: no "
    "MPI job is needed. Exit status: 0, or 1 when DIR holds no timeline file or the trace or picture cannot be written."
)

_FILE_GLOB = FILE_PATTERN.format(rank="*")
_FILE_RANK = re.compile(re.escape(FILE_PATTERN).replace(r"\{rank\}", r"(\d+)") + "$")
_DRIFT_SPAN_US = 10e6  # fit a drift only over runs of at least this many microseconds
_DRIFT_CHUNKS = 16  # ... from the medians of this many consecutive groups of collectives
_QUIET_SHARE, _QUIET_AT_LEAST = 4, 8  # the end times compared: the quarter of the agreements (at least 8) waited least


@dataclasses.dataclass
class RankTrace:
    """One rank's timeline file, as read: its events, and what was in the file besides them."""

    rank: int
    size: int
    host: str
    events: list[dict[str, Any]]
    skipped: int  # lines that were not events (a line cut short when the job was killed)
    complete: bool  # the file ended as written at exit
    world_tracks: dict[int, int]  # tid -> number among the communicators over every rank (files without
    # one: the position among this rank's)
    started: float  # the wall-clock time at which the rank opened the file (0 when the header has none)
    job: Optional[str]  # the job's identity, alike on every rank of one job (None when the header has none)


@dataclasses.dataclass
class Offset:
    """A rank's clock against the reference rank's: ``clock_r = clock_ref + offset_us + drift * (clock_ref - at_us)``.

    ``spread_us``: half the interquartile range of the agreements' end differences about the model (how
    precisely they pin the offset down); ``lower_us``/``upper_us``: what causality guarantees for the offset at
    ``at_us`` (an interval that contradicts itself, ``lower_us > upper_us``, says the model does not hold: a clock
    jumped).
    """

    rank: int
    offset_us: float
    drift: float
    at_us: float
    spread_us: float
    lower_us: float
    upper_us: float
    matched: int

    @property
    def consistent(self) -> bool:
        """Whether causality allows the estimate."""
        return self.lower_us <= self.offset_us <= self.upper_us

    def __call__(self, t_us: float) -> float:
        """The offset at time ``t_us`` of this rank's clock."""
        return self.offset_us + self.drift * (t_us - self.offset_us - self.at_us)


@dataclasses.dataclass
class Summary:
    """Where one rank's time went, in seconds, and how long the others waited for it."""

    rank: int
    host: str
    compute: float
    wait: float
    transfer: float
    last: int  # collectives at which this rank arrived last
    caused: float  # seconds the other ranks waited in those collectives


def read_trace(path: str) -> RankTrace:
    """Local: one rank's file. A file cut short (a killed job) is read up to its last whole line.

    Raises ``ValueError`` naming the file when it is not a timeline file, or cut short before its header.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a timeline file (not UTF-8 text)") from None
    skipped, complete = 0, True
    try:
        events = json.loads(text)
    except json.JSONDecodeError:
        events, complete = [], False
        for line in text.splitlines():
            line = line.strip().rstrip(",")
            if line in ("", "[", "]"):
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                skipped += 1
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{path}: not a timeline file (a JSON array of trace events)")
    header = next((e for e in events if e.get("name") == "timeline" and e.get("ph") == "i"), None)
    if header is None:
        raise ValueError(f"{path}: not an mpidist timeline file (no 'timeline' event)")
    info = header.get("args")
    try:
        rank, size, started = int(info["rank"]), int(info["size"]), float(info.get("wall_time", 0.0))
    except (TypeError, KeyError, ValueError):
        raise ValueError(
            f"{path}: not an mpidist timeline file (its 'timeline' event names no rank and size)"
        ) from None
    world = sorted(
        (e["tid"], e["args"])
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("args", {}).get("size") == size
    )
    return RankTrace(
        rank=rank,
        size=size,
        host=str(info.get("host", "?")),
        events=events,
        skipped=skipped,
        complete=complete,
        world_tracks={tid: args.get("world", i) for i, (tid, args) in enumerate(world)},
        started=started,
        job=None if info.get("job") is None else str(info["job"]),
    )


def read_directory(directory: str, notes: Optional[list[str]] = None) -> dict[int, RankTrace]:
    """Local: every rank's file in ``directory``, by rank, of one job: the one that started last.

    Files that cannot be read, that name another rank than their file name, or that come from another job
    (left there by an earlier run: of another size, or of another job identity where both files have one) are
    left out, each with a line saying why appended to ``notes`` (when given).
    """
    traces: dict[int, RankTrace] = {}
    for path in sorted(glob.glob(os.path.join(directory, _FILE_GLOB))):
        named = _FILE_RANK.search(os.path.basename(path))
        if not named:
            continue
        try:
            trace = read_trace(path)
        except OSError as exc:
            _note(notes, f"left out {path}: {exc.strerror or exc}")
            continue
        except ValueError as exc:  # names the file
            _note(notes, f"left out {exc}")
            continue
        if trace.rank != int(named.group(1)):
            _note(notes, f"left out {path}: it holds the events of rank {trace.rank}")
            continue
        traces[trace.rank] = trace
    if traces:
        job = max(traces.values(), key=lambda t: t.started)
        for rank, trace in sorted(traces.items()):
            if trace.size != job.size:
                _note(
                    notes,
                    f"left out rank {rank}'s file: it comes from another job, of {trace.size} ranks "
                    f"(the last job to start had {job.size})",
                )
                del traces[rank]
            elif None not in (trace.job, job.job) and trace.job != job.job:
                _note(
                    notes,
                    f"left out rank {rank}'s file: it comes from another job of {trace.size} ranks "
                    f"(job {trace.job}; the last job to start is {job.job})",
                )
                del traces[rank]
    return traces


def _note(notes: Optional[list[str]], line: str) -> None:
    """Local: ``line`` appended to ``notes``, unless that is ``None``."""
    if notes is not None:
        notes.append(line)


def agreements(trace: RankTrace) -> dict[tuple[int, int], tuple[float, float, float]]:
    """Local: the agreements of the communicators over every rank, by (communicator, collective number):
    their start and end (microseconds, this rank's clock) and how long this rank waited in them (0 for a
    nonblocking one, during which it may have computed)."""
    found = {}
    for event in trace.events:
        category = event.get("cat")
        if category == "wait" or category == "in flight":
            position = trace.world_tracks.get(event["tid"])
            if position is not None:  # a communicator over every rank
                wait = event["dur"] if category == "wait" else 0.0
                found[(position, event["args"]["seq"])] = (event["ts"], event["ts"] + event["dur"], wait)
    return found


# One agreement seen from a rank and the reference rank: (start, end, reference's start, reference's end).
_Pair = tuple[float, float, float, float]


def _fit(pairs: Sequence[_Pair], quiet: Sequence[_Pair], drift: float) -> tuple[float, float, float, float, float]:
    """(offset, at, spread, lower, upper) of the model with ``drift``, its offset at the reference clock's ``at``:
    the median of the ``quiet`` agreements' end differences, kept within the bounds that causality sets over all
    the ``pairs`` (when they hold)."""
    at = statistics.median(p[3] for p in quiet)
    differences = sorted(e - r - drift * (r - at) for _, e, _, r in quiet)
    estimate = statistics.median(differences)
    quarter = len(differences) // 4
    spread = (differences[-1 - quarter] - differences[quarter]) / 2
    lower = max(s - r - drift * (r - at) for s, _, _, r in pairs)
    upper = min(e - q - drift * (q - at) for _, e, q, _ in pairs)
    if lower <= upper:
        estimate = min(max(estimate, lower), upper)
    return estimate, at, spread, lower, upper


def _drift(quiet: Sequence[_Pair]) -> Optional[float]:
    """The slope of the end differences over time (least squares through the medians of consecutive groups),
    or ``None`` when the run is too short to tell a drift from the noise."""
    if len(quiet) < 2 * _DRIFT_CHUNKS or quiet[-1][3] - quiet[0][3] < _DRIFT_SPAN_US:
        return None
    size = len(quiet) // _DRIFT_CHUNKS
    xs, ys = [], []
    for k in range(_DRIFT_CHUNKS):
        group = quiet[k * size : (k + 1) * size]
        xs.append(statistics.median(r for _, _, _, r in group))
        ys.append(statistics.median(e - r for _, e, _, r in group))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _quiet(pairs: Sequence[_Pair]) -> list[_Pair]:
    """The agreements in which neither rank waited long, in time order: a rank that waits polls ever less
    often and notices the end later, so these ends are the ones that coincide."""
    waited = sorted(pairs, key=lambda p: max(p[1] - p[0], p[3] - p[2]))
    return sorted(waited[: max(_QUIET_AT_LEAST, len(pairs) // _QUIET_SHARE)], key=lambda p: p[3])


def align(traces: dict[int, RankTrace]) -> dict[int, Offset]:
    """Local: each rank's clock offset against the lowest rank's, from the agreements both recorded."""
    reference = min(traces)
    mine = {rank: agreements(trace) for rank, trace in traces.items()}
    offsets = {reference: Offset(reference, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, len(mine[reference]))}
    for rank in sorted(traces):
        if rank == reference:
            continue
        pairs = [(*mine[rank][k][:2], *mine[reference][k][:2]) for k in mine[rank].keys() & mine[reference].keys()]
        if not pairs:
            offsets[rank] = Offset(rank, 0.0, 0.0, 0.0, math.inf, -math.inf, math.inf, 0)
            continue
        quiet = _quiet(pairs)
        models = [(0.0, _fit(pairs, quiet, 0.0))]
        drift = _drift(quiet)
        if drift is not None:
            models.append((drift, _fit(pairs, quiet, drift)))
        # the model that causality allows and that fits the end differences more closely
        slope, (offset, at, spread, lower, upper) = min(models, key=lambda m: (m[1][3] > m[1][4], m[1][2]))
        offsets[rank] = Offset(rank, offset, slope, at, spread, lower, upper, len(pairs))
    return offsets


def _aligned(trace: RankTrace, offset: Offset) -> Iterable[dict[str, Any]]:
    """``trace``'s events with times on the reference rank's clock."""
    for event in trace.events:
        if "ts" in event:
            event = {**event, "ts": event["ts"] - offset(event["ts"])}
        yield event


def summarize(traces: dict[int, RankTrace], offsets: dict[int, Offset]) -> list[Summary]:
    """Local: per rank, seconds computing, waiting and transferring, and the waits it caused the others."""
    last: dict[int, int] = dict.fromkeys(traces, 0)
    caused: dict[int, float] = dict.fromkeys(traces, 0.0)
    mine = {rank: agreements(trace) for rank, trace in traces.items()}
    common = set.intersection(*(set(found) for found in mine.values())) if len(mine) > 1 else set()
    for key in common:
        starts = {rank: found[key][0] - offsets[rank](found[key][0]) for rank, found in mine.items()}
        latest = max(starts, key=lambda rank: starts[rank])
        waited = sum(found[key][2] for rank, found in mine.items() if rank != latest)
        if waited > 0:
            last[latest] += 1
            caused[latest] += waited / 1e6
    summaries = []
    for rank, trace in sorted(traces.items()):
        wait = sum(e["dur"] for e in trace.events if e.get("cat") == "wait")
        transfer = sum(e["dur"] for e in trace.events if e.get("cat") in ("transfer", "handle"))
        timed = [e for e in trace.events if e.get("ph") == "X"]
        span = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed) if timed else 0.0
        summaries.append(
            Summary(
                rank, trace.host, (span - wait - transfer) / 1e6, wait / 1e6, transfer / 1e6, last[rank], caused[rank]
            )
        )
    return summaries


def format_table(summaries: Sequence[Summary], offsets: dict[int, Offset]) -> str:
    """Local: the per-rank table, the clock offsets, and a line naming the rank the others waited for most."""
    rows = [("rank", "host", "computing", "waiting", "transferring", "last to arrive", "others waited for it")]
    for s in summaries:
        rows.append(
            (
                str(s.rank),
                s.host,
                human_time(max(s.compute, 0.0)),
                human_time(s.wait),
                human_time(s.transfer),
                f"{s.last} collectives",
                human_time(s.caused),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    reference = min(offsets)
    for rank, offset in sorted(offsets.items()):
        if rank == reference:
            continue
        if not offset.matched:
            lines.append(f"clock of rank {rank}: no collective in common with rank {reference}; not aligned")
            continue
        drift = f", drifting {offset.drift * 1e6:+.2f} us/s" if offset.drift else ""
        if offset.consistent:
            bound = (
                f"certainly between -{human_time((offset.offset_us - offset.lower_us) / 1e6)} "
                f"and +{human_time((offset.upper_us - offset.offset_us) / 1e6)} of it"
            )
        else:
            bound = "causality contradicts it: did a clock jump, or is this file from another job?"
        lines.append(
            f"clock of rank {rank}: {offset.offset_us / 1e6:+.6f} s against rank {reference}{drift}, "
            f"+- {human_time(offset.spread_us / 1e6)} ({offset.matched} collectives; {bound})"
        )
    total = sum(s.caused for s in summaries)
    worst = max(summaries, key=lambda s: s.caused, default=None)
    if worst is None or total <= 0:
        lines.append("no rank made the others wait (no collective over every rank was recorded by all of them)")
    else:
        lines.append(
            f"the others waited most for rank {worst.rank}: {human_time(worst.caused)} of their waiting "
            f"({100 * worst.caused / total:.0f}% of all waiting in collectives over every rank); it arrived last at "
            f"{worst.last} collectives"
        )
    return "\n".join(lines)


def merge(traces: dict[int, RankTrace], offsets: dict[int, Offset]) -> dict[str, Any]:
    """Local: one trace of every rank's events on the reference rank's clock, starting at 0."""
    events = [e for rank, trace in sorted(traces.items()) for e in _aligned(trace, offsets[rank])]
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "aligned to": f"rank {min(offsets)}",
            "clock offsets (us)": {
                str(rank): {
                    "offset": o.offset_us,
                    "drift": o.drift,
                    "spread": _finite(o.spread_us),
                    "lower": _finite(o.lower_us),
                    "upper": _finite(o.upper_us),
                    "collectives": o.matched,
                }
                for rank, o in sorted(offsets.items())
            },
        },
    }


def _finite(x: float) -> Optional[float]:
    """``x``, or ``None`` (JSON ``null``) for an infinity: no bound."""
    return x if math.isfinite(x) else None


def step_waits(trace: RankTrace) -> list[float]:
    """Local: the rank's wait in agreements (seconds) from the start of each of its steps to the start of the next
    (``strategy.run`` calls; the last step: to the end of its file)."""
    steps = sorted(e["ts"] for e in trace.events if e.get("cat") == "step")
    waits = [0.0] * len(steps)
    for event in trace.events:
        if event.get("cat") == "wait" and steps and event["ts"] >= steps[0]:
            i = _position(steps, event["ts"])
            waits[i] += event["dur"] / 1e6
    return waits


def _position(starts: Sequence[float], t: float) -> int:
    """The index of the last of the sorted ``starts`` at or before ``t``."""
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


def draw(traces: dict[int, RankTrace], summaries: Sequence[Summary], path: str) -> bool:
    """Local: the picture: each rank's wait per step, and where each rank's time went; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (steps_ax, totals_ax) = plt.subplots(
        2, 1, figsize=(9, 6.5), gridspec_kw={"height_ratios": [3, max(1, len(traces)) * 0.45 + 0.6]}
    )
    for rank, trace in sorted(traces.items()):
        waits = step_waits(trace)
        steps_ax.plot(range(1, len(waits) + 1), [w * 1e3 for w in waits], label=f"rank {rank}", linewidth=1.2)
    steps_ax.set_xlabel("step (strategy.run)")
    steps_ax.set_ylabel("wait for the other ranks (ms)")
    steps_ax.set_title("Each rank's wait in collectives per step: the rank the others wait for waits least")
    steps_ax.grid(True, alpha=0.3)
    steps_ax.legend(loc="upper right", fontsize="small")
    labels = [f"rank {s.rank}" for s in summaries]
    left = [0.0] * len(summaries)
    for part, color in (("compute", "#4c72b0"), ("wait", "#dd8452"), ("transfer", "#55a868")):
        values = [getattr(s, part) for s in summaries]
        label = {"compute": "computing", "wait": "waiting", "transfer": "transferring"}[part]
        totals_ax.barh(labels, values, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, values)]
    totals_ax.invert_yaxis()
    totals_ax.set_xlabel("seconds (from the rank's first event to its last)")
    totals_ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize="small", ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the timeline command's arguments to ``parser``."""
    parser.add_argument("directory", metavar="DIR", help="the directory the job's MPIDIST_TIMELINE named")
    parser.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="where to write the merged trace (default DIR/timeline.json)",
    )
    parser.add_argument(
        "--picture",
        metavar="FILE",
        default=None,
        help="where to draw each rank's wait per step (default DIR/timeline.png; needs matplotlib)",
    )
    parser.add_argument("--no-picture", action="store_true", help="draw no picture")


def run(args: argparse.Namespace) -> int:
    """Merge, print the table, draw the picture (see :func:`add_arguments`). Local."""
    notes: list[str] = []
    traces = read_directory(args.directory, notes)
    for line in notes:
        print(f"note: {line}")
    if not traces:
        found = "no timeline file that could be read" if notes else f"no {_FILE_GLOB} files"
        print(f"mpidist timeline: {found} in {args.directory}: run the job with MPIDIST_TIMELINE set")
        return 1
    size = max(t.size for t in traces.values())
    missing = sorted(set(range(size)) - set(traces))
    if missing:
        print(f"note: no file of rank(s) {', '.join(map(str, missing))}: merging the {len(traces)} there are")
    for rank, trace in sorted(traces.items()):
        if not trace.complete:
            cut = f", {trace.skipped} line(s) cut short skipped" if trace.skipped else ""
            print(f"note: rank {rank}'s file was not completed (the job was killed or is still running){cut}")
    offsets = align(traces)
    summaries = summarize(traces, offsets)
    out = args.out or os.path.join(args.directory, "timeline.json")
    try:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(merge(traces, offsets), f, separators=(",", ":"))
    except OSError as exc:
        print(
            f"mpidist timeline: error: cannot write the merged trace to {out}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1
    print(format_table(summaries, offsets))
    print(f"merged trace: {out} (open it at https://ui.perfetto.dev or chrome://tracing)")
    if not args.no_picture:
        picture = args.picture or os.path.join(args.directory, "timeline.png")
        try:
            drawn = draw(traces, summaries, picture)
        except OSError as exc:
            print(
                f"mpidist timeline: error: cannot draw the picture to {picture}: {exc.strerror or exc}", file=sys.stderr
            )
            return 1
        if drawn:
            print(f"picture: {picture}")
        else:
            print("no picture: it needs matplotlib (pip install 'mpidist[timeline]')")
    return 0
