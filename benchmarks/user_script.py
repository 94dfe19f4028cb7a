"""The calls of a training step, made and timed as a user's script does, against ``python -m mpidist bench``.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/user_script.py
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/user_script.py --results bench-results/results.json
    # options: --samples 11 --cases update,resnet_update,resnet_reduce,small --update-bytes 67108864 --shrink 1

Each case makes its calls the way a training script makes them: a "backward pass" writes new values into
the gradients (the same arrays every step, values that depend on the rank and the step), then one call;
the call alone is timed, from a barrier to its return, and the slowest rank's time counts. A sample is one
call (for the 8-byte case: the mean of 500 calls, what a loop of them costs per call); a number is the
median of the samples.

- ``update``: a 64 MiB mirrored MEAN variable, ``v.assign_add(g)`` in ``strategy.run``, against the hand
  loop ``Allreduce(g, tmp); tmp *= 1/N; w += tmp``.
- ``resnet_update``: ResNet-50's 161 parameter shapes as flat variables (``flat_variables=True``, gradients
  from ``flat_zeros_like``), ``strategy.batch_update(..., in_place=True)``, against the hand loop per array.
- ``resnet_reduce``: the SUM of the 161 gradients with ``strategy.reduce(out=)``,
  ``ReplicaContext.all_reduce(out=)`` and in place (``out=`` the gradients), against one raw in-place
  ``Allreduce`` per array.
- ``small``: the 8-byte update (two float32) against its hand loop.

Alternating with these samples, round by round in the same run, the script times the benchmark's own
variants of the same calls (``mpidist._tools.bench``: its arrays, its sampling), so that both see the same
load on the machine, and prints both and their ratio "bench / script", which should be 1 within noise.
With ``--results`` it also prints what that earlier run of ``python -m mpidist bench`` measured.

The imports are in the order a formatter sorts them, ``mpi4py`` before ``mpidist``, as in most scripts:
MPI starts before mpidist can choose its settings. Under Open MPI that leaves the algorithm of the
nonblocking allreduce (``OMPI_MCA_coll_libnbc_iallreduce_algorithm``) to Open MPI, where ``python -m
mpidist bench`` runs with mpidist's choice; the script prints the setting of both runs. Set the variable
to the benchmark's value (``1``) to compare like with like.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist._tools import bench as mpidist_bench
from mpidist._tools.bench_report import median, placements

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
CASES = ("update", "resnet_update", "resnet_reduce", "small")
SMALL_SAMPLES = 500  # calls per sample of the 8-byte case
_steps = [0]


def backward(grads: list[np.ndarray]) -> None:
    """What a training step's backward pass leaves: new values in every gradient."""
    _steps[0] += 1
    value = 1.0 + rank + (_steps[0] % 64) / 64
    for g in grads:
        g[...] = value


def timed(call: Callable[[], Any]) -> float:
    """The slowest rank's seconds for one call, all ranks starting together."""
    comm.Barrier()
    start = time.perf_counter()
    call()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def in_replica(strategy: mpidist.MPIStrategy, step: Callable[[], float]) -> float:
    """``step()`` inside ``strategy.run``, as a training step runs."""
    result = []
    with strategy.scope():
        strategy.run(lambda: result.append(step()))
    return result[0]


def hand_loop(g: np.ndarray, tmp: np.ndarray, w: np.ndarray) -> None:
    """The mirrored MEAN update a user writes by hand."""
    comm.Allreduce(g, tmp, MPI.SUM)
    np.multiply(tmp, 1 / size, out=tmp)
    w += tmp


def update_case(strategy: mpidist.MPIStrategy, nbytes: int) -> dict[str, Callable[[], float]]:
    """One sample each: a mirrored MEAN ``assign_add`` of ``nbytes`` of float32, and the hand loop."""
    n = nbytes // 4
    g = np.empty(n, np.float32)
    tmp, w = np.full(n, 0.5, np.float32), np.full(n, 0.5, np.float32)
    with strategy.scope():
        v = mpidist.Variable(np.full(n, 0.5, np.float32), aggregation=mpidist.VariableAggregation.MEAN)

    def mpidist_step() -> float:
        backward([g])
        return timed(lambda: v.assign_add(g))

    def hand_step() -> float:
        backward([g])
        return timed(lambda: hand_loop(g, tmp, w))

    return {"mpidist": lambda: in_replica(strategy, mpidist_step), "hand_loop": hand_step}


def resnet_update_case(shapes: list[tuple[int, ...]]) -> tuple[dict[str, Callable[[], float]], mpidist.MPIStrategy]:
    """``batch_update(in_place=True)`` of flat variables, and the hand loop per array."""
    flat = mpidist.MPIStrategy(device="cpu", flat_variables=True)
    with flat.scope():
        variables = [
            mpidist.Variable(np.full(s, 0.5, np.float32), aggregation=mpidist.VariableAggregation.MEAN) for s in shapes
        ]
    grads = flat.flat_zeros_like(variables)
    hand_grads = [np.empty(s, np.float32) for s in shapes]
    tmps = [np.full(s, 0.5, np.float32) for s in shapes]
    weights = [np.full(s, 0.5, np.float32) for s in shapes]

    def mpidist_step() -> float:
        backward(grads)
        return timed(lambda: flat.batch_update(zip(variables, grads), in_place=True))

    def hand_step() -> float:
        backward(hand_grads)
        return timed(lambda: [hand_loop(g, t, w) for g, t, w in zip(hand_grads, tmps, weights)])

    return {"batch_update_flat_in_place": lambda: in_replica(flat, mpidist_step), "hand_loop": hand_step}, flat


def resnet_reduce_case(strategy: mpidist.MPIStrategy, shapes: list[tuple[int, ...]]) -> dict[str, Callable[[], float]]:
    """The SUM of the gradients into ``out=``, by ``ReplicaContext.all_reduce(out=)``, in place; raw per array."""
    grads = [np.empty(s, np.float32) for s in shapes]
    out = [np.full(s, 0.5, np.float32) for s in shapes]

    def reduce_out() -> float:
        backward(grads)
        return timed(lambda: strategy.reduce("sum", grads, out=out))

    def all_reduce_step() -> float:
        backward(grads)
        return timed(lambda: mpidist.get_replica_context().all_reduce("sum", grads, out=out))

    def reduce_in_place() -> float:
        backward(grads)
        return timed(lambda: strategy.reduce("sum", grads, out=grads))

    def raw() -> float:
        backward(grads)
        return timed(lambda: [comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM) for g in grads])

    return {
        "reduce_out": reduce_out,
        "all_reduce_out": lambda: in_replica(strategy, all_reduce_step),
        "reduce_in_place": reduce_in_place,
        "raw_per_array": raw,
    }


# (case, the script's name of a call) -> (the benchmark's case and key in results.json, its variant's name)
BENCH_NAMES = {
    ("update", "mpidist"): ("update", None, "mpidist"),
    ("update", "hand_loop"): ("update", None, "hand_loop"),
    ("resnet_update", "batch_update_flat_in_place"): ("resnet50", "161 arrays", "mpidist_batch_update_flat_in_place"),
    ("resnet_update", "hand_loop"): ("resnet50", "161 arrays", "hand_loop_per_array"),
    ("resnet_reduce", "reduce_out"): ("resnet50", "161 arrays", "mpidist_reduce_list_out"),
    ("resnet_reduce", "all_reduce_out"): ("resnet50", "161 arrays", "mpidist_all_reduce_out"),
    ("resnet_reduce", "reduce_in_place"): ("resnet50", "161 arrays", "mpidist_reduce_list_in_place"),
    ("resnet_reduce", "raw_per_array"): ("resnet50", "161 arrays", "raw_per_array"),
    ("small", "mpidist"): ("update", "8", "mpidist"),
    ("small", "hand_loop"): ("update", "8", "hand_loop"),
}
BASELINES = {
    "update": "hand_loop",
    "resnet_update": "hand_loop",
    "resnet_reduce": "raw_per_array",
    "small": "hand_loop",
}


def _settings(settings: dict[str, Optional[str]]) -> str:
    return ", ".join(f"{name}={value if value is not None else '(not set)'}" for name, value in settings.items())


def _time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=11, help="rounds of samples (median reported)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--update-bytes", type=int, default=64 << 20, help="size of the update case (64 MiB)")
    parser.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="divide the first dimension of every ResNet-50 shape by this (tests use small arrays)",
    )
    parser.add_argument("--results", help="results.json of a run of `python -m mpidist bench` to print as well")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    shapes = [(max(1, s[0] // args.shrink), *s[1:]) for s in mpidist_bench.resnet50_shapes()]
    strategy = mpidist.MPIStrategy(device="cpu")
    # the benchmark's own variants of the same calls, timed by its own sampling
    bench = mpidist_bench.Bench(args.samples, None)
    bench_strategies = mpidist_bench.make_strategies()
    script: dict[str, dict[str, Callable[[], float]]] = {}
    benched: dict[str, dict[str, mpidist_bench.Variant]] = {}
    extra = []
    resnet = None
    for case in cases:
        if case in ("resnet_update", "resnet_reduce") and resnet is None:
            resnet = mpidist_bench.resnet_variants(bench, bench_strategies, shapes)
        if case == "update":
            script[case] = update_case(strategy, args.update_bytes)
            variants = mpidist_bench.update_variants(bench, bench_strategies, args.update_bytes)
        elif case == "small":
            script[case] = update_case(strategy, 8)
            variants = mpidist_bench.update_variants(bench, bench_strategies, 8)
        elif case == "resnet_update":
            script[case], flat = resnet_update_case(shapes)
            extra.append(flat)
            variants = resnet
        else:
            script[case] = resnet_reduce_case(strategy, shapes)
            variants = resnet
        benched[case] = {name: variants[BENCH_NAMES[case, name][2]] for name in script[case]}

    def script_sample(case: str, call: Callable[[], float]) -> float:
        return statistics.fmean(call() for _ in range(SMALL_SAMPLES)) if case == "small" else call()

    calls = {case: SMALL_SAMPLES if case == "small" else 1 for case in cases}
    mine = {case: {name: [] for name in script[case]} for case in cases}
    theirs = {case: {name: [] for name in script[case]} for case in cases}
    for case in cases:  # warm up both
        for name, call in script[case].items():
            call()
            bench.sample(benched[case][name], 1)
    probes = [bench.probe()]  # where the ranks ran, before the first round and after each (as the benchmark does)
    for round_ in range(args.samples):
        for case in cases:
            for name, call in script[case].items():
                if round_ % 2:  # which of the two goes first alternates, so that neither always follows the other
                    theirs[case][name].append(bench.sample(benched[case][name], calls[case]))
                mine[case][name].append(script_sample(case, call))
                if not round_ % 2:
                    theirs[case][name].append(bench.sample(benched[case][name], calls[case]))
        probes.append(bench.probe())
    # in the benchmark's format, so that its report labels the rounds and takes the medians of the shared ones
    measured = {
        case: {
            who: {
                "probes": probes,
                **{name: {"median_s": statistics.median(s), "samples_s": s} for name, s in samples[case].items()},
            }
            for who, samples in (("script", mine), ("bench", theirs))
        }
        for case in cases
    }
    placements(measured)
    saved = None
    if args.results:
        with open(args.results) as f:
            saved = json.load(f)
    if rank == 0:
        _report(args, cases, measured, saved)
    for s in [strategy, *extra, *bench_strategies.values()]:
        s.free()
    return 0


def _saved(
    saved: Optional[dict[str, Any]], case: str, name: str, args: argparse.Namespace, shared: bool = False
) -> Optional[float]:
    """The median of the same call in an earlier benchmark run's results.json, or ``None`` (not the same size)."""
    if saved is None or (case.startswith("resnet") and args.shrink != 1):
        return None
    bench_case, key, variant = BENCH_NAMES[case, name]
    return median(saved["results"].get(bench_case, {}).get(key or str(args.update_bytes), {}), variant, shared)


def _report(args: argparse.Namespace, cases: list[str], measured: dict[str, Any], saved: Optional[dict]) -> None:
    mpi = " ".join(MPI.Get_library_version().splitlines()[0].split())
    print(
        f"{size} ranks, {mpi}; medians of {args.samples} rounds; script: one call per sample"
        f"{f' (for small: the mean of {SMALL_SAMPLES})' if 'small' in cases else ''}; bench: the benchmark's "
        "sampling of its own variants of the same calls, alternating with the script's"
    )
    settings = mpidist_bench.mpi_settings()
    print(f"MPI settings of this run: {_settings(settings)}")
    rounds = measured[cases[0]]["script"]["rounds"]
    print(
        f"placement of the ranks (the benchmark's probe around each round): {rounds.count('shared')} rounds "
        f"sharing a cache, {rounds.count('split')} not, {rounds.count('mixed')} changing"
    )
    if saved is not None:
        meta = saved["meta"]
        basis = "" if meta.get("inputs") else " (OLD BASIS: never-written gradients)"
        print(
            f"saved benchmark run: {args.results}, {meta['date']}, {meta['mpi']}{basis}; MPI settings: "
            f"{_settings(meta.get('mpi_settings', {}))}"
        )
        if meta.get("mpi_settings", {}) != settings:
            print("NOTE: the saved run had other MPI settings than this run: its times need not agree with these")
    print()
    print("| case | call | script | bench, same run | bench / script | saved bench run | saved / script |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        for name in measured[case]["script"]:
            if name in ("probes", "rounds"):
                continue
            m, t = median(measured[case]["script"], name), median(measured[case]["bench"], name)
            s = _saved(saved, case, name, args)
            print(f"| {case} | {name} | {_time(m)} | {_time(t)} | {_ratio(t, m)} | {_time(s)} | {_ratio(s, m)} |")
    print()
    print(
        "| case | call | vs | script | bench, same run | script, shared rounds | bench, shared rounds "
        "| saved bench run | saved, shared rounds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        base = BASELINES[case]
        for name in measured[case]["script"]:
            if name in ("probes", "rounds", base):
                continue
            ratios = [
                _ratio(median(measured[case][who], name, shared), median(measured[case][who], base, shared))
                for shared in (False, True)
                for who in ("script", "bench")
            ]
            ratios += [
                _ratio(_saved(saved, case, name, args, shared), _saved(saved, case, base, args, shared))
                for shared in (False, True)
            ]
            print(f"| {case} | {name} | {base} | " + " | ".join(ratios) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
