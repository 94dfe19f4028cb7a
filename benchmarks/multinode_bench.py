"""Allreduce across nodes at the link limit: raw MPI, mpidist flat, two-level and default, against the links.

    sudo benchmarks/multinode.sh [OUT]     # nodes up, links shaped, this job under each MPI, nodes down
    sudo COMPRESSION=1 RATES=1gbit benchmarks/multinode.sh [OUT]   # the wire compression mode
    # by hand, across nodes (docs/multinode.md shows the launchers):
    mpiexec ... python benchmarks/multinode_bench.py --out DIR --rate 1gbit --link "1gbit tbf"
    python benchmarks/multinode_bench.py --report OUT      # one table and plot of every run under OUT

For each size (float32 SUM, 64 KiB to 256 MiB, doubling), in rounds of one sample of each variant
(interleaved, so that every variant sees the same load), the median over ``--repeats`` rounds of:

- ``link``, ``link_pieces``: the link bound, measured. One rank on each node (the node's
  first) sends the buffer to the next node's and receives one from the previous node's
  (``Sendrecv``; on two nodes, a two-way exchange of the buffer between them): every link then
  carries the buffer once each way, at once. ``link`` exchanges the whole buffer in one
  ``Sendrecv``, ``link_pieces`` in one ``Sendrecv`` per piece of ``piece_bytes`` (2 MiB), as
  mpidist's reductions run: here one whole exchange often ran at half the rate the pieces got.
  The faster of the two is the exchange's time; a two-level reduction over N nodes must carry
  2 (N - 1) / N buffers over each link each way (its leaders' allreduce, as a ring does): that
  many times the exchange is the bound.
- ``raw``: ``MPI_Allreduce`` in place over every rank (the library's tuned choice).
- ``flat``, ``two_level``, ``default``: ``strategy.reduce("sum", x, out=x)`` with
  ``hierarchical=False``, ``True`` and not set (the default; checks on, as by default).

With ``--compression`` the job times instead, beside the link bound, a mirrored variable's
replica-context MEAN update (``assign_add`` of the buffer, float32) by the default strategy
(``exact``) and by strategies with ``compression="fp16"`` and ``"bf16"``: the ratios of the
compressed updates to the exact one.

Before every call the buffer is written with new values that depend on the rank and the call, as
a backward pass writes gradients (:class:`mpidist._tools.bench.Gradients`), then a barrier, then
the call alone is timed; a call's time is the slowest rank's, a sample the mean of enough calls to
last about 50 ms (at least one).

Bus bandwidth here is the link's: ``2 (N - 1) / N`` bytes over each node's link, each way, per
byte reduced (N nodes), per second, in Gbit/s. The ``link`` variant's is then the bytes per
second the links carried, so a reduction at the bound reaches the link's line on the plot.

Writes ``results.json`` and ``results.md`` to ``--out``; ``--report`` writes ``multinode.md`` and
(with matplotlib) ``multinode.png`` from every ``results.json`` under a folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

import mpidist  # before mpi4py.MPI: mpidist's MPI settings apply, as under `python -m mpidist`
from mpidist._comm.library import library_version
from mpidist._tools.bench import Gradients, Variant, mpi_settings, sample
from mpidist._units import human_size, human_time

_MIB = 1 << 20
_SAMPLE_SECONDS = 0.05
_MAX_CALLS = 200
VARIANTS = ("link", "link_pieces", "raw", "flat", "two_level", "default")
COMPRESSED = ("exact", "fp16", "bf16")  # the strategies of the compression mode, by their compression
LABELS = {
    "link": "link bound (two-way Sendrecv)",
    "raw": "raw MPI_Allreduce",
    "flat": "mpidist flat",
    "two_level": "mpidist two-level",
    "default": "mpidist default",
}


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, n = [], min_bytes
    while n <= max_bytes:
        out.append(n)
        n *= 2
    return out


class Job:
    """The collective part: communicators, strategies and the timing of one sample."""

    def __init__(self, raw_max_bytes: int, compression: bool = False) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.rank, node.size
        node.Free()
        leader = self.local_rank == 0
        self.leaders = self.comm.Split(0 if leader else MPI.UNDEFINED, self.rank)
        self.nodes = self.comm.allreduce(int(leader))
        self.hosts = self.comm.allgather(MPI.Get_processor_name())
        self.gradients = Gradients(self.rank)
        self.raw_max_bytes = raw_max_bytes
        self.compression = compression
        if compression:
            self.strategies = {
                name: mpidist.MPIStrategy(
                    device="cpu", compression=None if name == "exact" else name, abort_on_error=False
                )
                for name in COMPRESSED
            }
            self.strategies["default"] = self.strategies["exact"]  # for chosen()
        else:
            self.strategies = {
                "flat": mpidist.MPIStrategy(device="cpu", hierarchical=False, abort_on_error=False),
                "two_level": mpidist.MPIStrategy(device="cpu", hierarchical=True, abort_on_error=False),
                "default": mpidist.MPIStrategy(device="cpu", abort_on_error=False),
            }

    def variants(self, buf: np.ndarray, other: np.ndarray) -> dict[str, Variant]:
        MPI, comm = self.MPI, self.comm
        write = self.gradients.writer([buf])
        out: dict[str, Variant] = {"link": Variant(self._link(buf, other, buf.size), write)}
        piece = self.strategies["default"].options.piece_bytes // buf.itemsize
        if buf.size > piece:
            out["link_pieces"] = Variant(self._link(buf, other, piece), write)
        if self.compression:
            for name in COMPRESSED:
                strategy = self.strategies[name]
                with strategy.scope():
                    variable = mpidist.Variable(
                        np.full(buf.shape, 0.25, np.float32),
                        aggregation=mpidist.VariableAggregation.MEAN,
                        name=f"update{buf.nbytes}",
                    )
                out[name] = Variant(lambda v=variable: v.assign_add(buf), write, strategy)
            return out
        if buf.nbytes <= self.raw_max_bytes:
            out["raw"] = Variant(lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), write)
        for name, strategy in self.strategies.items():
            out[name] = Variant(lambda s=strategy: s.reduce("sum", buf, out=buf), write)
        return out

    def _link(self, buf: np.ndarray, other: np.ndarray, piece: int) -> Callable[[], Any]:
        """The exchange over every link (the nodes' first ranks), one ``Sendrecv`` per ``piece`` elements."""
        leaders = self.leaders
        if leaders == self.MPI.COMM_NULL:
            return lambda: None
        n, r = leaders.size, leaders.rank
        spans = [(lo, lo + piece) for lo in range(0, buf.size, piece)]

        def exchange() -> None:
            for lo, hi in spans:
                leaders.Sendrecv(buf[lo:hi], (r + 1) % n, 0, other[lo:hi], (r - 1) % n, 0)

        return exchange

    def sample(self, variant: Variant, calls: int) -> float:
        """Collective: seconds per call (the slowest rank's, averaged over ``calls``), each call timed alone."""
        return sample(self.comm, variant, calls)

    def chosen(self, nbytes: int) -> str:
        """The algorithm the default strategy takes for one call of ``nbytes`` (its first piece)."""
        strategy = self.strategies["default"]
        piece = min(nbytes, strategy.options.piece_bytes)
        return type(strategy.communicator._algorithms.choose(piece)).__name__

    def measure(self, nbytes: int, repeats: int) -> dict[str, Any]:
        buf, other = np.full(nbytes // 4, 0.5, np.float32), np.full(nbytes // 4, 0.5, np.float32)
        variants = self.variants(buf, other)
        calls = {}
        for name, variant in variants.items():
            once = self.sample(variant, 1)  # warm-up: lazily made connections and buffers
            calls[name] = max(1, min(_MAX_CALLS, int(_SAMPLE_SECONDS / max(once, 1e-6))))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, variant in variants.items():
                samples[name].append(self.sample(variant, calls[name]))
        entry: dict[str, Any] = {
            name: {"median_s": statistics.median(s), "samples_s": s, "calls": calls[name]}
            for name, s in samples.items()
        }
        entry["default_algorithm"] = self.chosen(nbytes)
        return entry

    def free(self) -> None:
        for s in dict.fromkeys(self.strategies.values()):
            s.free()
        if self.leaders != self.MPI.COMM_NULL:
            self.leaders.Free()
        self.comm.Free()


def rate_bits(rate: str) -> Optional[int]:
    """Bits per second of a tc rate (``1gbit``, ``500mbit``); ``None`` for ``none`` (the links are not shaped)."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, scale in units.items():
        if rate.endswith(unit) and rate[: -len(unit)].isdigit():
            return int(rate[: -len(unit)]) * scale
    if rate == "none":
        return None
    raise ValueError(f"rate {rate!r}: expected none or a number followed by one of {', '.join(units)}")


def bound_factor(nodes: int) -> float:
    """Buffers over each node's link, each way, per buffer reduced, for an allreduce over ``nodes`` nodes."""
    return 2 * (nodes - 1) / nodes if nodes > 1 else 1.0


def link_gbps(nbytes: int, seconds: Optional[float], nodes: int) -> Optional[float]:
    """Bus bandwidth of an allreduce over the nodes' links (Gbit/s), see the module's docstring."""
    return None if not seconds else bound_factor(nodes) * nbytes * 8 / seconds / 1e9


def exchange_s(entry: dict[str, Any]) -> float:
    """The measured exchange (seconds): the faster of the whole buffer and its pieces."""
    return min(float(entry[name]["median_s"]) for name in ("link", "link_pieces") if name in entry)


def bound_s(entry: dict[str, Any], nodes: int) -> float:
    """The two-level reduction's link bound (seconds), from the measured exchange."""
    return exchange_s(entry) * bound_factor(nodes)


def _median(entry: dict[str, Any], name: str) -> Optional[float]:
    v = entry.get(name)
    return v["median_s"] if isinstance(v, dict) else None


def _t(seconds: Optional[float]) -> str:
    return "-" if seconds is None else human_time(seconds)


def _x(seconds: Optional[float], bound: float) -> str:
    return "-" if seconds is None else f"{seconds / bound:.2f}x"


def _gbps(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def title(meta: dict[str, Any]) -> str:
    settings = "".join(f", {k}={v}" for k, v in meta.get("mpi_settings", {}).items() if v is not None)
    return f"{meta['nodes']} nodes x {meta['per_node']} ranks, {meta['link']}, {meta['mpi_short']}{settings}"


def table(meta: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """Markdown: per size the exchange, the times, each over the bound, and the link bus bandwidth."""
    nodes = meta["nodes"]
    lines = [
        "| size | exchange: whole / pieces | link bound | raw | flat | two-level | default (picks) "
        "| raw / bound | flat / bound | two-level / bound | default / bound "
        "| busbw raw | flat | two-level | default | link (Gbit/s) |",
        "|---" * 16 + "|",
    ]
    for key, e in sorted(results.items(), key=lambda kv: int(kv[0])):
        nbytes, bound = int(key), bound_s(e, nodes)
        med = {name: _median(e, name) for name in VARIANTS}
        picks = "two-level" if e.get("default_algorithm") == "Hierarchical" else "flat"
        lines.append(
            f"| {human_size(nbytes)} | {_t(med['link'])} / {_t(med['link_pieces'])} | {_t(bound)} | "
            f"{_t(med['raw'])} | {_t(med['flat'])} | {_t(med['two_level'])} | {_t(med['default'])} ({picks}) | "
            + " | ".join(_x(med[n], bound) for n in ("raw", "flat", "two_level", "default"))
            + " | "
            + " | ".join(_gbps(link_gbps(nbytes, med[n], nodes)) for n in ("raw", "flat", "two_level", "default"))
            + f" | {_gbps(link_gbps(nbytes, bound, nodes))} |"
        )
    return lines


def compression_table(meta: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """Markdown: per size the link bound, the exact and compressed updates, and their ratios."""
    nodes = meta["nodes"]
    lines = [
        "| size | exchange: whole / pieces | link bound | exact update (algorithm) | fp16 | bf16 "
        "| fp16 / exact | bf16 / exact | fp16 / exact, round by round | bf16 / exact, round by round "
        "| exact / bound |",
        "|---" * 11 + "|",
    ]
    for key, e in sorted(results.items(), key=lambda kv: int(kv[0])):
        nbytes, bound = int(key), bound_s(e, nodes)
        med = {name: _median(e, name) for name in ("link", "link_pieces", *COMPRESSED)}
        algorithm = "two-level" if e.get("default_algorithm") == "Hierarchical" else "flat"
        lines.append(
            f"| {human_size(nbytes)} | {_t(med['link'])} / {_t(med['link_pieces'])} | {_t(bound)} | "
            f"{_t(med['exact'])} ({algorithm}) | {_t(med['fp16'])} | {_t(med['bf16'])} | "
            + " | ".join(_x(med[n], med["exact"] or 1.0) for n in ("fp16", "bf16"))
            + " | "
            + " | ".join(_rounds(e, n, "exact") for n in ("fp16", "bf16"))
            + f" | {_x(med['exact'], bound)} |"
        )
    return lines


def _rounds(entry: dict[str, Any], name: str, base: str) -> str:
    """``name / base`` round by round (the rounds are interleaved): median (min-max)."""
    a, b = entry[name]["samples_s"], entry[base]["samples_s"]
    ratios = sorted(x / y for x, y in zip(a, b))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def markdown(meta: dict[str, Any]) -> str:
    compression = meta.get("mode") == "compression"
    what = "Wire compression across nodes" if compression else "Allreduce across nodes"
    rows = compression_table(meta, meta["results"]) if compression else table(meta, meta["results"])
    explained = (
        "exact, fp16, bf16: a mirrored variable's MEAN update (assign_add, replica context) of the float32 "
        "buffer by the default strategy and by strategies with compression='fp16' and 'bf16'."
        if compression
        else "busbw: that many bytes per byte reduced, per second, in Gbit/s."
    )
    return (
        "\n".join(
            [
                f"# {what}: {title(meta)}",
                "",
                f"{meta['date']}; {meta['mpi']}; mpidist {meta['mpidist']}, Python {meta['python']}, NumPy "
                f"{meta['numpy']}; {meta['ranks']} ranks on {meta['nodes']} nodes ({meta['placement']}); "
                f"{meta['cpus']} CPUs; medians of {meta['repeats']} interleaved rounds; load average "
                f"{meta['load_before']} before, {meta['load_after']} after; {meta['seconds']:.0f} s.",
                "",
                "exchange: a raw two-way Sendrecv of the buffer between the nodes' first ranks, whole or in pieces "
                f"of 2 MiB; link bound: the faster x {bound_factor(meta['nodes']):g} (2 (N - 1) / N buffers over "
                f"each link each way, N nodes); {explained}",
                "",
                *rows,
            ]
        )
        + "\n"
    )


def run(args: argparse.Namespace) -> int:
    job = Job(args.raw_max_bytes, args.compression)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = {}
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        entry = job.measure(nbytes, args.repeats)
        results[str(nbytes)] = entry
        if job.rank == 0:
            shown = ", ".join(f"{n} {_t(_median(entry, n))}" for n in (*VARIANTS, *COMPRESSED) if n in entry)
            print(f"[multinode] {human_size(nbytes)}: {shown} (default: {entry['default_algorithm']})", flush=True)
    if job.rank == 0:
        version = library_version()
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "mpi": version,
            "mpi_short": "Open MPI" if "open mpi" in version.lower() else "MPICH",
            "mpidist": mpidist.__version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "ranks": job.size,
            "nodes": job.nodes,
            "per_node": job.local_size,
            "placement": "; ".join(
                f"{h}: {', '.join(str(r) for r, x in enumerate(job.hosts) if x == h)}" for h in dict.fromkeys(job.hosts)
            ),
            "link": args.link,
            "rate_bits": rate_bits(args.rate),
            "mpi_settings": mpi_settings(),
            "repeats": args.repeats,
            "mode": "compression" if args.compression else "allreduce",
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "seconds": time.perf_counter() - started,
            "results": results,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(meta, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(meta))
        print(markdown(meta), flush=True)
    job.free()
    return 0


def plot(runs: Sequence[dict[str, Any]], path: Path) -> bool:
    """One panel per run: link bus bandwidth against size, the measured link bound drawn in."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    columns = min(2, len(runs))
    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.2 * rows), squeeze=False)
    styles = {
        "raw": ("tab:red", "s"),
        "flat": ("tab:orange", "^"),
        "two_level": ("tab:blue", "o"),
        "default": ("tab:green", "x"),
    }
    for ax, meta in zip(axes.flat, runs):
        nodes, keyed = meta["nodes"], sorted((int(k), e) for k, e in meta["results"].items())
        xs = [n for n, _ in keyed]
        ax.plot(xs, [link_gbps(n, bound_s(e, nodes), nodes) for n, e in keyed], "k--", label=LABELS["link"])
        if meta.get("rate_bits"):
            ax.axhline(meta["rate_bits"] / 1e9, color="grey", linestyle=":", label="shaped rate (nominal)")
        for name, (color, marker) in styles.items():
            points = [(n, link_gbps(n, _median(e, name), nodes)) for n, e in keyed if _median(e, name)]
            if points:
                ax.plot(*zip(*points), color=color, marker=marker, markersize=4, label=LABELS[name])
        ax.set_xscale("log", base=2)
        ax.set_xticks([x for x in xs if x.bit_length() % 2 == 1])
        ax.set_xticklabels([human_size(x).replace(" ", "") for x in xs if x.bit_length() % 2 == 1], fontsize=8)
        ax.set_xlabel("float32 SUM allreduce")
        ax.set_ylabel("link bus bandwidth (Gbit/s)")
        ax.set_ylim(bottom=0)
        ax.set_title(title(meta), fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(runs) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def report(folder: Path) -> int:
    every = [json.loads(p.read_text()) for p in sorted(folder.glob("**/results.json"))]
    runs = [m for m in every if m.get("mode") != "compression"]  # the plot's; compression runs: tables only
    if not every:
        print(f"no results.json under {folder}", file=sys.stderr)
        return 1
    runs.sort(key=lambda m: (m["nodes"], m["per_node"], m.get("rate_bits") or 1 << 62, m["mpi_short"]))
    text = []
    for meta in runs + [m for m in every if m.get("mode") == "compression"]:
        text += [f"## {title(meta)}", "", markdown(meta).split("\n", 2)[2]]
    (folder / "multinode.md").write_text("\n".join(text))
    written = ["multinode.md"] + (["multinode.png"] if runs and plot(runs, folder / "multinode.png") else [])
    print(f"wrote {', '.join(str(folder / w) for w in written)}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="multinode-results", help="folder for results.json and results.md")
    parser.add_argument("--rate", default="none", help="the links' shaped rate in tc's units (1gbit), or none")
    parser.add_argument("--link", default="unshaped", help="what the links are, in words, for the report")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of samples (medians reported)")
    parser.add_argument("--min-bytes", type=int, default=64 * 1024)
    parser.add_argument("--max-bytes", type=int, default=256 * _MIB)
    parser.add_argument(
        "--raw-max-bytes", type=int, default=256 * _MIB, help="largest buffer raw MPI_Allreduce is timed at"
    )
    parser.add_argument(
        "--compression",
        action="store_true",
        help="time the mirrored MEAN update exact and with compression fp16 and bf16, instead of the allreduces",
    )
    parser.add_argument("--report", type=Path, help="write multinode.md and .png from the runs under this folder")
    args = parser.parse_args(argv)
    return report(args.report) if args.report else run(args)


if __name__ == "__main__":
    sys.exit(main())
