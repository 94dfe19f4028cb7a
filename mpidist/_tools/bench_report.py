"""Reports of the benchmark results (see :mod:`mpidist._tools.bench`): a Markdown table and a PNG plot.

Local: runs on one rank after the measurements. The plot needs matplotlib
(the ``bench`` extra); without it only the Markdown is written.
"""
from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["goals", "write_reports"]

_MIB = 1 << 20


def _t(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _med(entry: dict[str, Any], name: str) -> Optional[float]:
    value = entry.get(name)
    return value["median_s"] if isinstance(value, dict) else None


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _busbw(nbytes: int, seconds: float, ranks: int) -> float:
    """Bus bandwidth in GB/s: ``2 (n - 1) / n`` bytes moved per byte reduced (algorithm bandwidth at n = 1)."""
    factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    return factor * nbytes / seconds / 1e9


def goals(meta: dict[str, Any], results: dict[str, Any]) -> list[tuple[str, str, Optional[bool]]]:
    """The issue's goals: (goal, what was reached, met?) from one run's results (``None``: not measured)."""
    rows: list[tuple[str, str, Optional[bool]]] = []
    update = results.get("update", {})
    for key in (str(64 * _MIB), str(256 * _MIB)):
        for name, how in (("mpidist", "`assign_add`"), ("mpidist_in_place", "`batch_update(in_place=True)`")):
            if key in update:
                r = _med(update[key], name) / _med(update[key], "raw_allreduce_divide")
                rows.append((f"{_size(int(key))} mirrored MEAN update, {how}, <= 0.5x raw Allreduce(IN_PLACE) "
                             "+ divide", f"{r:.2f}x", r <= 0.5))
    resnet = results.get("resnet50", {}).get("161 arrays")
    for name, how in (("mpidist_fused_flat", "flat"), ("mpidist_fused_flat_in_place", "flat, in place")):
        if resnet:
            r = _med(resnet, name) / _med(resnet, "raw_per_array")
            rows.append((f"ResNet-50 fused update ({how}) <= 0.5x one raw Allreduce per array", f"{r:.2f}x",
                         r <= 0.5))
    if "8" in update:
        on = _med(update["8"], "mpidist") / _med(update["8"], "raw_allreduce")
        off = _med(update["8"], "mpidist_nocheck") / _med(update["8"], "raw_allreduce")
        rows.append(("8 B mirrored update, agreement check on, <= 2x one raw Allreduce", f"{on:.1f}x", on <= 2))
        rows.append(("8 B mirrored update, agreement check off, <= 1.2x one raw Allreduce", f"{off:.1f}x", off <= 1.2))
    sweep = results.get("sweep", {})
    gloo = [(int(k), _med(e, "gloo") / _med(e, "mpidist")) for k, e in sweep.items() if _med(e, "gloo")]
    if gloo:
        worst = min(gloo, key=lambda kv: kv[1])
        rows.append(("at least 3x faster than torch gloo at every size",
                     f"worst {worst[1]:.1f}x at {_size(worst[0])}", worst[1] >= 3))
    if sweep:
        worst = max(((int(k), _med(e, "mpidist") / _med(e, "raw")) for k, e in sweep.items()), key=lambda kv: kv[1])
        rows.append(("no size where mpidist is > 10% slower than raw mpi4py",
                     f"worst {worst[1]:.2f}x at {_size(worst[0])}", worst[1] <= 1.1))
    if str(256 * _MIB) in update:
        extra = update[str(256 * _MIB)]["peak_extra_bytes"]
        limit = 2 * update[str(256 * _MIB)]["pipeline_bytes"]
        rows.append(("256 MiB update: peak memory grows by at most 2 pieces",
                     f"{extra / _MIB:.2f} MiB (2 pieces: {limit / _MIB:g} MiB)", extra <= limit))
    return rows


def _markdown(meta: dict[str, Any], results: dict[str, Any]) -> str:
    n = meta["ranks"]
    out = [f"# mpidist benchmark: {n} ranks, {meta['mpi']}", "",
           f"{meta['date']}; Python {meta['python']}, NumPy {meta['numpy']}, torch {meta['torch'] or '(not run)'}; "
           f"{meta['cpus']} CPUs; medians of {meta['repeats']} samples (slowest rank); "
           f"pipeline_bytes {_size(meta['pipeline_bytes'])}, fusion_bytes {_size(meta['fusion_bytes'])}; "
           f"{meta['seconds']} s in all.", "", "## Goals", "", "| goal | reached | met |", "|---|---|---|"]
    out += [f"| {g} | {r} | {'yes' if ok else 'no' if ok is not None else '-'} |" for g, r, ok in goals(meta, results)]
    if "sweep" in results:
        out += ["", "## Allreduce sweep (float32 SUM, in place)", "",
                "| size | raw mpi4py | mpidist | mpidist/raw | mpidist, check off | gloo | gloo/mpidist | busbw mpidist GB/s |",
                "|---|---|---|---|---|---|---|---|"]
        for key, e in sorted(results["sweep"].items(), key=lambda kv: int(kv[0])):
            m = _med(e, "mpidist")
            out.append(f"| {_size(int(key))} | {_t(_med(e, 'raw'))} | {_t(m)} | {_ratio(m, _med(e, 'raw'))} | "
                       f"{_t(_med(e, 'mpidist_nocheck'))} | {_t(_med(e, 'gloo'))} | {_ratio(_med(e, 'gloo'), m)} | "
                       f"{_busbw(int(key), m, n):.2f} |")
    if "pieces" in results:
        names = list(next(iter(results["pieces"].values())))
        out += ["", "## Piece size (mpidist allreduce, check off)", "",
                "| size | " + " | ".join(_size(int(p)) if p.isdigit() else "one call" for p in names) + " |",
                "|---" * (len(names) + 1) + "|"]
        for key, e in sorted(results["pieces"].items(), key=lambda kv: int(kv[0])):
            out.append(f"| {_size(int(key))} | " + " | ".join(_t(_med(e, p)) for p in names) + " |")
    if "update" in results:
        out += ["", "## Mirrored MEAN update (`v.assign_add(g)` in replica context)", "",
                "| size | raw Allreduce | raw + divide | raw + divide + update | mpidist | mpidist, check off | "
                "mpidist, in place | gloo + divide + update | mpidist / (raw + divide) | peak extra memory |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for key, e in sorted(results["update"].items(), key=lambda kv: int(kv[0])):
            m = _med(e, "mpidist")
            out.append(f"| {_size(int(key))} | {_t(_med(e, 'raw_allreduce'))} | {_t(_med(e, 'raw_allreduce_divide'))} | "
                       f"{_t(_med(e, 'raw_user_update'))} | {_t(m)} | {_t(_med(e, 'mpidist_nocheck'))} | "
                       f"{_t(_med(e, 'mpidist_in_place'))} | {_t(_med(e, 'gloo_user_update'))} | {_ratio(m, _med(e, 'raw_allreduce_divide'))} | "
                       f"{e['peak_extra_bytes'] / _MIB:.2f} MiB |")
    for case, title, base in (("resnet50", "ResNet-50 parameter shapes (161 float32 arrays, 97.5 MiB)",
                               "raw_per_array"),
                              ("fusion", "fusion_bytes (ResNet-50 fused update of ordinary arrays)", "0")):
        for e in results.get(case, {}).values():
            out += ["", f"## {title}", "", f"| variant | time | vs {base} |", "|---|---|---|"]
            out += [f"| {name} | {_t(_med(e, name))} | {_ratio(_med(e, name), _med(e, base))} |"
                    for name, v in e.items() if isinstance(v, dict)]
    for key, e in results.get("overlap", {}).items():
        out += ["", "## Nonblocking: progress during computation", "",
                f"{_size(int(key))}: blocking allreduce {_t(_med(e, 'blocking'))}; started with `iallreduce`, then "
                f"as long a computation without MPI calls, then `wait()`: {_t(e['wait_after_compute_s'])} "
                f"({e['left_for_wait']:.2f} of the blocking time was left for `wait()`)."]
    return "\n".join(out) + "\n"


def _plot(meta: dict[str, Any], results: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = sorted(results["sweep"].items(), key=lambda kv: int(kv[0]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, label in (("mpidist", "mpidist"), ("raw", "raw mpi4py Allreduce"), ("gloo", "torch gloo")):
        points = [(int(k), _busbw(int(k), _med(e, name), meta["ranks"])) for k, e in sweep if _med(e, name)]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"float32 SUM allreduce, {meta['ranks']} ranks, {meta['mpi'].split(',')[0]}")
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
