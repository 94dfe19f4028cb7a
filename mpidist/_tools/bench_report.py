"""Reports of the benchmark results (see :mod:`mpidist._tools.bench`): Markdown tables and a PNG plot.

The reports state times and ratios against the baselines measured in the same
run; they pass no verdict. Local: runs on one rank after the measurements.
The plot needs matplotlib (the ``bench`` extra); without it only the Markdown
is written.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from mpidist._units import human_size, human_time

__all__ = ["median", "placements", "scaling_tables", "write_reports"]

# Where the ranks ran during a round of samples, from the probes around it: a raw 1 MiB allreduce over a copy of
# 1 MiB within a rank. On a virtual machine the hypervisor moves the cores: with the ranks on cores that share a
# cache the allreduce took 6-10 local copies on the machine of docs/benchmarks.md (both MPIs), on cores that do
# not 19-35.
_SHARED, _SPLIT, _MIXED = "shared", "split", "mixed"
_SHARED_BELOW = 12.0  # both probes at most this many copies: the ranks shared a cache
_SPLIT_FROM = 15.0  # both at least this many: they did not
_MIN_ROUNDS = 3  # fewest rounds of a kind for a median of that kind


def _t(seconds: Optional[float]) -> str:
    return "-" if seconds is None else human_time(seconds)


def piece_bytes(record: dict[str, Any]) -> int:
    """Local: the piece size a results record was measured with (``pipeline_bytes`` in files of earlier versions)."""
    return int(record["piece_bytes"] if "piece_bytes" in record else record["pipeline_bytes"])


def median(entry: dict[str, Any], name: str, shared: bool = False) -> Optional[float]:
    """Local: the median seconds of variant ``name`` in one ``results.json`` entry (``None``: not measured).

    With ``shared``, over the rounds in which the ranks shared a cache
    (``None`` with fewer than three such rounds; see :func:`placements`).
    """
    value = entry.get(name)
    if not isinstance(value, dict):
        return None
    return value.get("median_shared_s") if shared else value["median_s"]


def placements(results: dict[str, Any]) -> None:
    """Local: label every round of samples by where the ranks ran, and add the medians of shared rounds.

    Each entry measured with probes (``probes``: ``[allreduce seconds, copy
    seconds]`` before the first round and after each) gets ``rounds``: per
    round ``"shared"`` (both probes' allreduce at most 12 copies),
    ``"split"`` (both at least 15) or ``"mixed"``; each of its variants gets
    ``median_shared_s``, the median of its samples in shared rounds (``None``
    with fewer than three).
    """
    for case in results.values():
        for e in case.values():
            ps = [allreduce / copy for allreduce, copy in e.get("probes", ())]
            if not ps:
                continue
            rounds = [
                _SHARED if max(a, b) <= _SHARED_BELOW else _SPLIT if min(a, b) >= _SPLIT_FROM else _MIXED
                for a, b in zip(ps, ps[1:])
            ]
            e["rounds"] = rounds
            for v in e.values():
                if isinstance(v, dict) and "samples_s" in v:
                    kept = [t for t, r in zip(v["samples_s"], rounds) if r == _SHARED]
                    v["median_shared_s"] = statistics.median(kept) if len(kept) >= _MIN_ROUNDS else None


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _paired(entry: dict[str, Any], name: str, base: str) -> str:
    """The ratio ``name / base`` round by round (the samples are interleaved): median (min-max) over the rounds."""
    a, b = entry.get(name, {}).get("samples_s"), entry.get(base, {}).get("samples_s")
    if not a or not b or len(a) != len(b) or not all(b):
        return "-"
    ratios = sorted(x / y for x, y in zip(a, b))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}, {len(ratios)} rounds)"


def _busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in GB/s: ``2 (n - 1) / n`` bytes moved per byte reduced (algorithm bandwidth at n = 1)."""
    factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    return factor * nbytes / seconds / 1e9


def _table(title: str, header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown section: a ``##`` title and a table."""
    return [
        "",
        f"## {title}",
        "",
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _by_size(case: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The entries of a case keyed by a size in bytes, smallest first."""
    return sorted((int(key), entry) for key, entry in case.items())


def _sweep_row(nbytes: int, e: dict[str, Any], ranks: int) -> list[str]:
    m, raw, gloo = median(e, "mpidist"), median(e, "raw"), median(e, "gloo")
    return [
        human_size(nbytes),
        _t(raw),
        _t(m),
        _ratio(m, raw),
        _t(median(e, "mpidist_nocheck")),
        _t(gloo),
        _ratio(gloo, m),
        "-" if m is None else f"{_busbw(nbytes, m, ranks):.2f}",
    ]


# Bytes each update moves through memory per float32 element, outside MPI: the fused update reads the
# gradient and reads and writes the weight (its pieces stay in cache); the hand loop also writes the
# full-size temporary, reads and writes it to scale it, and reads it again to add it.
_FUSED_BYTES, _HAND_LOOP_BYTES = 12, 28


def _update_row(nbytes: int, e: dict[str, Any], add_gbps: Optional[float]) -> list[str]:
    hand, m, batch = median(e, "hand_loop"), median(e, "mpidist"), median(e, "mpidist_batch_update")
    floor = None if add_gbps is None else nbytes // 4 * _FUSED_BYTES / (add_gbps * 1e9)
    times = [
        _t(median(e, name))
        for name in (
            "raw_allreduce",
            "hand_loop",
            "mpidist",
            "mpidist_batch_update",
            "mpidist_in_place",
            "mpidist_nocheck",
            "gloo_hand_loop",
        )
    ]
    return [
        human_size(nbytes),
        *times,
        _ratio(m, hand),
        _ratio(batch, hand),
        _t(floor),
        _ratio(m, floor),
        human_size(e["peak_extra_bytes"]),
    ]


def _alltoall_rows(case: dict[str, Any]) -> list[list[str]]:
    """Rows of the alltoall table: per size (bytes per rank) even splits, then uneven ones."""
    keyed = sorted((int(key.split()[0]), key.split()[1], e) for key, e in case.items())
    rows = []
    for nbytes, splits, e in keyed:
        m, raw, nocheck = median(e, "mpidist"), median(e, "raw"), median(e, "mpidist_nocheck")
        rows.append(
            [
                human_size(e.get("bytes", nbytes)),
                splits,
                _t(raw),
                _t(m),
                _ratio(m, raw),
                _paired(e, "mpidist", "raw"),
                _t(nocheck),
                _ratio(nocheck, raw),
            ]
        )
    return rows


def _bfloat16_row(nbytes: int, e: dict[str, Any]) -> list[str]:
    raw, single, half = median(e, "raw_float32"), median(e, "float32"), median(e, "bfloat16")
    return [
        f"{nbytes // 4:,}",
        human_size(nbytes),
        _t(raw),
        _t(single),
        _t(half),
        _ratio(half, single),
        _paired(e, "bfloat16", "float32"),
        _ratio(single, raw),
    ]


def _compression_row(nbytes: int, e: dict[str, Any]) -> list[str]:
    exact, fp16, bf16 = median(e, "exact"), median(e, "fp16"), median(e, "bf16")
    return [
        human_size(nbytes),
        _t(exact),
        _t(fp16),
        _t(bf16),
        _paired(e, "fp16", "exact"),
        _paired(e, "bf16", "exact"),
    ]


def _layers(e: dict[str, Any]) -> list[list[str]]:
    """Rows of the profile: each layer's time and what it adds to the one before (the hand loop for reference)."""
    rows, before = [], None
    for name in e:
        t = median(e, name)
        if t is None:
            continue
        added = "" if before is None or name == "hand_loop" else _t(t - before)
        rows.append([name, _t(t), added])
        if name != "hand_loop":
            before = t
    return rows


# The collectives of the scaling case, in the order of its tables.
_SCALING = (
    ("update_8B", "8 B mirrored update"),
    ("allreduce_1MiB", "1 MiB allreduce"),
    ("barrier", "barrier"),
)


def _number(x: float) -> str:
    """A count per call: whole when it is (``1,224``), else with two decimals (``1.88``)."""
    return f"{x:,.0f}" if x == round(x) else f"{x:,.2f}"


def _mean_most(per_rank: Optional[Sequence[float]]) -> str:
    """``mean / most`` of a count over the ranks ("-": not counted)."""
    return "-" if per_rank is None else f"{_number(statistics.mean(per_rank))} / {_number(max(per_rank))}"


def _mpi_calls(count: dict[str, Any]) -> str:
    """The MPI calls of one collective: how many, and which (``2: Iallreduce, Start``)."""
    calls = count["mpi_calls"]
    text = f"{_number(sum(calls.values()))}: {', '.join(calls)}" if calls else "0"
    return text if count["mpi_calls_alike"] else f"{text} (rank 0; other ranks differ)"


def scaling_tables(runs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """Local: the Markdown tables of the ``scaling`` case over runs (``(meta, results)``, one per number of ranks).

    Counts per collective and per rank, for every run; times for the runs
    that timed the collectives (at most one rank per core); then how the
    messages were counted.
    """
    runs = sorted(((m, r["scaling"]) for m, r in runs if "scaling" in r), key=lambda run: int(run[0]["ranks"]))
    counted, timed, notes = [], [], []
    for meta, case in runs:
        n = int(meta["ranks"])
        for key, label in _SCALING:
            e = case.get(key)
            if e is None:
                continue
            mine, raw = e["counts"]["mpidist"], e["counts"]["raw"]
            received = mine["received_bytes"]
            counted.append(
                [
                    str(n),
                    str(math.ceil(math.log2(n))) if n > 1 else "0",
                    label,
                    _mpi_calls(mine),
                    _mean_most(mine["messages"]),
                    _mean_most(mine["bytes"]),
                    "-" if received is None else _number(max(received)),
                    _mean_most(raw["messages"]),
                    _mean_most(raw["bytes"]),
                ]
            )
            m, r = median(e, "mpidist"), median(e, "raw")
            if m is not None:
                timed.append([str(n), label, _t(r), _t(m), _ratio(m, r), _paired(e, "mpidist", "raw")])
        first = next(iter(case.values()))
        notes.append(
            f"{n} ranks, {meta['mpi']}: {first['counted_by']}; MPI calls and messages per call over "
            f"{first['counted_calls']} calls of each collective"
            + (f"; not timed ({first['not_timed']})" if "not_timed" in first else "")
            + "."
        )
    if not counted:
        return []
    out = _table(
        "Agreement cost against the number of ranks: counted (per collective)",
        [
            "N",
            "⌈log₂ N⌉",
            "collective",
            "MPI calls by mpidist",
            "mpidist: messages sent per rank, mean / most",
            "mpidist: bytes sent per rank, mean / most",
            "mpidist: bytes received, most",
            "raw mpi4py: messages sent per rank, mean / most",
            "raw mpi4py: bytes sent per rank, mean / most",
        ],
        counted,
    )
    out += [
        "",
        "mpidist with its default settings (the agreement and the deadline): the 8 B update is `assign_add` of a "
        "mirrored MEAN variable of two float32 in replica context, the 1 MiB allreduce the communicator's in-place "
        "float32 SUM, the barrier the communicator's. Raw mpi4py makes one call each: the hand loop's `Allreduce`, "
        "an in-place `Allreduce`, `Barrier`. Messages and bytes are the point-to-point messages the MPI library "
        "sent, its collective algorithms' own included, per call; bytes received are the same messages seen from "
        "the other end.",
        "",
        *(f"- {note}" for note in notes),
    ]
    if timed:
        out += _table(
            "Agreement cost against the number of ranks: timed (at most one rank per core)",
            ["N", "collective", "raw mpi4py", "mpidist", "mpidist / raw", "mpidist / raw, round by round"],
            timed,
        )
    return out


def _placement(meta: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """The probes' summary: their range, and how many rounds ran with the ranks sharing a cache or not."""
    entries = [(case, key, e) for case, keyed in results.items() for key, e in keyed.items() if e.get("rounds")]
    if not entries:
        return []
    probes = [p for _, _, e in entries for p in e["probes"]]
    ratios = [allreduce / copy for allreduce, copy in probes]
    counts = {kind: sum(e["rounds"].count(kind) for _, _, e in entries) for kind in (_SHARED, _SPLIT, _MIXED)}
    few = [f"{case} {key}" for case, key, e in entries if e["rounds"].count(_SHARED) < _MIN_ROUNDS]
    return [
        "",
        "## Placement of the ranks",
        "",
        f"Probe before and after each round of samples: a raw 1 MiB allreduce against a copy of 1 MiB within "
        f"a rank (slowest rank's medians of five), {_t(min(p[0] for p in probes))} to "
        f"{_t(max(p[0] for p in probes))}, {min(ratios):.1f} to {max(ratios):.1f} copies. Rounds with the ranks "
        f"sharing a cache (both probes at most {_SHARED_BELOW:g} copies): {counts[_SHARED]}; not sharing one "
        f"(both at least {_SPLIT_FROM:g}): {counts[_SPLIT]}; changing: {counts[_MIXED]}. The tables give the "
        "medians of all rounds. "
        + (
            f"Fewer than {_MIN_ROUNDS} shared rounds: {', '.join(few)}."
            if few
            else f"Every measurement had at least {_MIN_ROUNDS} shared rounds."
        )
        + (
            f" More ranks ({meta['ranks']}) than this node has CPUs ({meta['cpus']}): the probes also measure the "
            "ranks taking turns on the cores, so a slow round need not mean a split placement."
            if meta["ranks"] > meta["cpus"]
            else ""
        ),
    ]


def _markdown(meta: dict[str, Any], results: dict[str, Any]) -> str:
    out = [
        f"# mpidist benchmark: {meta['ranks']} ranks, {meta['mpi']}",
        "",
        f"{meta['date']}; Python {meta['python']}, NumPy {meta['numpy']}, torch {meta['torch'] or '(not run)'}; "
        f"{meta['cpus']} CPUs; medians of {meta['repeats']} samples (slowest rank); "
        f"piece_bytes {human_size(piece_bytes(meta))}, fusion_bytes {human_size(meta['fusion_bytes'])}; "
        f"{meta['seconds']} s in all.",
    ]
    if meta.get("inputs"):
        settings = ", ".join(
            f"{name}={'(not set)' if value is None else value}" for name, value in meta.get("mpi_settings", {}).items()
        )
        out += [
            "",
            f"Inputs: {meta['inputs']} (gradients written with new values before every call, as a training "
            f"step writes them; weights written once). MPI settings: {settings or '-'}.",
        ]
    out += _placement(meta, results)
    if "sweep" in results:
        out += _table(
            "Allreduce sweep (float32 SUM, in place)",
            [
                "size",
                "raw mpi4py",
                "mpidist",
                "mpidist/raw",
                "mpidist, check off",
                "gloo",
                "gloo/mpidist",
                "busbw mpidist GB/s",
            ],
            (_sweep_row(nbytes, e, meta["ranks"]) for nbytes, e in _by_size(results["sweep"])),
        )
    if "pieces" in results:
        names = [name for name, v in next(iter(results["pieces"].values())).items() if isinstance(v, dict)]
        out += _table(
            "Piece size (mpidist allreduce, check off)",
            ["size", *(human_size(int(p)) if p.isdigit() else "one call" for p in names)],
            ([human_size(nbytes), *(_t(median(e, p)) for p in names)] for nbytes, e in _by_size(results["pieces"])),
        )
    add_gbps = None
    for nbytes, e in _by_size(results.get("memory", {})):
        add_gbps = e["add_GBps"]
        out += [
            "",
            "## Memory bandwidth (every rank at once)",
            "",
            f"{human_size(nbytes)} arrays: copy {e['copy_GBps']:.1f} GB/s, add {e['add_GBps']:.1f} GB/s "
            "(bytes read and written per second, per rank).",
        ]
    if "update" in results:
        out += _table(
            "Mirrored MEAN update (`v.assign_add(g)` in replica context)",
            [
                "size",
                "raw Allreduce",
                "hand loop",
                "mpidist",
                "batch_update",
                "batch_update, in place",
                "mpidist, check off",
                "gloo hand loop",
                "mpidist / hand loop",
                "batch_update / hand loop",
                "floor",
                "mpidist / floor",
                "peak extra memory",
            ],
            (_update_row(nbytes, e, add_gbps) for nbytes, e in _by_size(results["update"])),
        )
        out += [
            "",
            f"Memory traffic outside MPI, bytes per element: mpidist {_FUSED_BYTES} (reads the gradient, "
            f"reads and writes the weight, a piece at a time), the hand loop {_HAND_LOOP_BYTES} (it also "
            "writes, scales and reads a full-size temporary). floor: mpidist's bytes at the measured add "
            "bandwidth, with no communication at all.",
        ]
    for case, title, bases in (
        (
            "resnet50",
            "ResNet-50 parameter shapes (161 float32 arrays, 97.5 MiB)",
            ("hand_loop_per_array", "raw_per_array", "raw_per_array_out"),
        ),
        ("fusion", "fusion_bytes (ResNet-50 fused update of ordinary arrays)", ("0",)),
    ):
        for e in results.get(case, {}).values():
            out += _table(
                title,
                ["variant", "time", *(f"vs {base}" for base in bases)],
                (
                    [name, _t(median(e, name)), *(_ratio(median(e, name), median(e, base)) for base in bases)]
                    for name, v in e.items()
                    if isinstance(v, dict)
                ),
            )
    labels = {
        "all_off": "every check off",
        "check_only": "check only",
        "deadline_only": "deadline only",
        "default": "default (check + deadline)",
    }
    for key, title, base in (
        ("allreduce_8B", "Safety settings: 8-byte allreduce", "raw"),
        ("update_8B", "Safety settings: 8-byte mirrored MEAN update", "hand_loop"),
    ):
        e = results.get("safety", {}).get(key)
        if e:
            out += _table(
                title,
                ["variant", "time", "vs every check off", "vs every check off, round by round", f"vs {base}"],
                (
                    [
                        labels.get(name, name),
                        _t(median(e, name)),
                        _ratio(median(e, name), median(e, "all_off")),
                        _paired(e, name, "all_off"),
                        _ratio(median(e, name), median(e, base)),
                    ]
                    for name in e
                    if median(e, name) is not None
                ),
            )
    for key, title in (
        ("allreduce_8B", "Timeline: 8-byte allreduce"),
        ("update_8B", "Timeline: 8-byte mirrored MEAN update"),
    ):
        e = results.get("timeline", {}).get(key)
        if e:
            out += _table(
                title,
                ["timeline", "time", "vs off", "vs off, round by round"],
                (
                    [name, _t(median(e, name)), _ratio(median(e, name), median(e, "off")), _paired(e, name, "off")]
                    for name in ("off", "on")
                ),
            )
    profile = results.get("profile", {}).get("update_8B")
    if profile:
        out += _table(
            "Where an 8-byte mirrored update's time goes (default settings)",
            ["layer", "time", "added by this layer"],
            _layers(profile),
        )
    if "alltoall" in results:
        out += _table(
            "Alltoall (float32 rows, `comm.alltoall(rows, splits)`)",
            [
                "size per rank",
                "splits",
                "raw",
                "mpidist",
                "mpidist/raw",
                "mpidist/raw, round by round",
                "mpidist, check off",
                "check off/raw",
            ],
            _alltoall_rows(results["alltoall"]),
        )
        out += [
            "",
            "raw: one `Alltoall` for even splits; for uneven ones (each rank its own), the counts by `Alltoall` "
            "and then the rows by `Alltoallv`; each allocates its receive buffer in the call, as mpidist "
            "allocates its result.",
        ]
    half = results.get("bfloat16", {})
    if "skipped" in half:
        out += ["", "## bfloat16 allreduce beside float32", "", f"Not measured: {half['skipped']['reason']}."]
    elif half:
        out += _table(
            "bfloat16 allreduce beside float32 (SUM, in place, as many elements)",
            [
                "elements",
                "float32 size",
                "raw float32",
                "mpidist float32",
                "mpidist bfloat16",
                "bfloat16/float32",
                "bfloat16/float32, round by round",
                "float32/raw",
            ],
            (_bfloat16_row(nbytes, e) for nbytes, e in _by_size(half)),
        )
    if results.get("compression"):
        out += _table(
            "Wire compression: mirrored MEAN update (assign_add) of float32",
            ["size", "exact", "fp16", "bf16", "fp16/exact, round by round", "bf16/exact, round by round"],
            (_compression_row(nbytes, e) for nbytes, e in _by_size(results["compression"])),
        )
    out += scaling_tables([(meta, results)])
    for nbytes, e in _by_size(results.get("overlap", {})):
        out += [
            "",
            "## Nonblocking: progress during computation",
            "",
            f"{human_size(nbytes)}: blocking allreduce {_t(median(e, 'blocking'))}; started with `iallreduce`, "
            f"then as long a computation without MPI calls, then `wait()`: {_t(e['wait_after_compute_s'])} "
            f"({e['left_for_wait']:.2f} of the blocking time was left for `wait()`).",
        ]
    return "\n".join(out) + "\n"


def _plot(meta: dict[str, Any], results: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = _by_size(results["sweep"])
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, label in (("mpidist", "mpidist"), ("raw", "raw mpi4py Allreduce"), ("gloo", "torch gloo")):
        times = [(nbytes, median(e, name)) for nbytes, e in sweep]
        points = [(nbytes, _busbw(nbytes, t, meta["ranks"])) for nbytes, t in times if t]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"float32 SUM allreduce, {meta['ranks']} ranks, {meta['mpi']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_reports(meta: dict[str, Any], results: dict[str, Any], out: str) -> list[str]:
    """Write ``results.md`` (and ``busbw.png`` when matplotlib is installed) to ``out``; return the paths."""
    paths = [os.path.join(out, "results.md")]
    with open(paths[0], "w") as f:
        f.write(_markdown(meta, results))
    png = os.path.join(out, "busbw.png")
    if "sweep" in results and _plot(meta, results, png):
        paths.append(png)
    return paths
