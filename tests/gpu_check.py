#!/usr/bin/env python3
"""One command for a GPU node: gpu tests, the CUDA-aware self-test and a device benchmark, one summary.

    python3 tests/gpu_check.py [--ranks 2] [--max-bytes 268435456] [--out gpu-check.json]

Uses the CuPy and the MPI already installed next to this Python (never pip):
``mpiexec`` from ``$MPIEXEC``, else next to ``sys.executable``, else on ``PATH``.
Steps, each under a timeout:

1. the CUDA-aware decision (``MPIDIST_CUDA_AWARE=auto``: the MPI library's query,
   then the one-time device-buffer allreduce);
2. the tests marked ``gpu`` under ``mpiexec -n RANKS``, staged (``MPIDIST_CUDA_AWARE=0``)
   and, where step 1 enabled it and there are two GPUs, CUDA-aware (``=1``);
3. busbw of mpidist's allreduce on device buffers against raw mpi4py ``Allreduce`` of
   the same CuPy arrays, staged and CUDA-aware, 1 KiB .. ``--max-bytes``.

With ``MPIDIST_TEST_DEVICE=standin`` it runs against the CPU stand-in for CuPy
(tests/helpers/standin/), CUDA-aware included, with sizes up to 4 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STANDIN = os.environ.get("MPIDIST_TEST_DEVICE") == "standin"

_PROBE = r"""
import json, sys
from mpi4py import MPI
from mpidist._comm.backend import Backend
from mpidist._comm.cuda_aware import decide_cuda_aware, library_cuda_support
from mpidist._comm.topology import node_split
node = node_split(MPI.COMM_WORLD)
backend = Backend.select("gpu", node.rank)
d = decide_cuda_aware(MPI.COMM_WORLD, backend, "auto")
import cupy
if MPI.COMM_WORLD.rank == 0:
    print("RESULT " + json.dumps({"enabled": d.enabled, "reason": d.reason, "source": d.source,
          "query": library_cuda_support(), "gpus": cupy.cuda.runtime.getDeviceCount(),
          "cupy": cupy.__version__, "mpi": MPI.Get_library_version().splitlines()[0].strip()}))
"""

_BENCH = r"""
import json, sys, time
import numpy as np
from mpi4py import MPI
import cupy
from mpidist._comm.communicator import Communicator
from mpidist._options import Options
max_bytes, modes = int(sys.argv[1]), sys.argv[2].split(",")
world = MPI.COMM_WORLD
n = world.size
rows = []
for mode in modes:
    comm = Communicator(world, Options.resolve(device="gpu", cuda_aware="1" if mode == "cuda-aware" else "0"))
    stream = cupy.cuda.get_current_stream()
    size = 1024
    while size <= max_bytes:
        x = cupy.ones(size // 4, dtype=cupy.float32)
        host = np.empty(size // 4, np.float32)
        reps = max(3, min(50, (64 << 20) // size))

        def raw():
            stream.synchronize()
            if mode == "cuda-aware":
                world.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
            else:
                x.get(out=host)
                world.Allreduce(MPI.IN_PLACE, host, MPI.SUM)
                x.set(host)
                stream.synchronize()

        def ours():
            comm.allreduce(x, "sum", inplace=True)
            stream.synchronize()

        row = {"mode": mode, "bytes": size}
        for name, fn in (("raw", raw), ("mpidist", ours)):
            fn()
            times = []
            for _ in range(reps):
                world.Barrier()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            seconds = float(np.median(times))
            seconds = world.allreduce(seconds, MPI.MAX)
            row[name + "_s"] = seconds
            row[name + "_busbw_GBs"] = 2 * (n - 1) / n * size / seconds / 1e9
        rows.append(row)
        size *= 4
    comm.free()
if world.rank == 0:
    print("RESULT " + json.dumps(rows))
"""


def _mpiexec() -> list[str]:
    exe = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(exe):
        exe = shutil.which("mpiexec") or "mpiexec"
    args = [exe]
    if "open mpi" in subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.lower():
        args += ["--oversubscribe", "--bind-to", "none"]
    return args


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    paths = [ROOT] + ([os.path.join(HERE, "helpers", "standin")] if STANDIN else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _launch(ranks: int, args: list[str], timeout: float, **env: str) -> tuple[int, str, float]:
    cmd = _mpiexec() + ["-n", str(ranks), sys.executable, "-m", "mpi4py"] + args
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out + f"\n(timed out after {timeout:g} s)", time.monotonic() - start


def _result(output: str) -> object:
    for line in output.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def _summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if " passed" in line or " failed" in line or " error" in line]
    return lines[-1].strip() if lines else "(no pytest summary)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=(4 << 20) if STANDIN else (256 << 20))
    parser.add_argument("--out", default="gpu-check.json", help="where the JSON summary goes")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per step")
    args = parser.parse_args()
    summary: dict = {"device": "CuPy stand-in (CPU)" if STANDIN else "CuPy", "ranks": args.ranks, "steps": {}}
    if not STANDIN:
        try:
            import cupy  # noqa: F401  (the installed CuPy; this command never installs anything)
        except ImportError as exc:
            print(
                f"gpu_check: CuPy is not importable ({exc}); install the CuPy for this node's CUDA "
                "(pip install 'mpidist[cuda12]' or 'mpidist[cuda13]'), or set MPIDIST_TEST_DEVICE=standin"
            )
            return 2

    rc, out, secs = _launch(args.ranks, ["-c", _PROBE], args.timeout, MPIDIST_CUDA_AWARE="auto")
    probe = _result(out) if rc == 0 else None
    summary["steps"]["self-test"] = {"rc": rc, "seconds": round(secs, 1), "result": probe}
    if probe is None:
        print(out[-4000:])
        print("gpu_check: the CUDA-aware probe failed; see the output above")
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        return 1
    modes = {"staged": "0"}
    why_not = None
    if probe["gpus"] < 2 and not STANDIN:
        why_not = f"only {probe['gpus']} GPU visible: CUDA-aware transfers between GPUs need two"
    elif not probe["enabled"] and not STANDIN:
        why_not = probe["reason"]
    else:
        modes["cuda-aware"] = "1"
    summary["cuda_aware_missing"] = why_not

    ok = True
    for mode, setting in modes.items():
        rc, out, secs = _launch(
            args.ranks,
            [
                "-m",
                "pytest",
                "--with-mpi",
                "-q",
                "-m",
                "gpu",
                "-p",
                "no:cacheprovider",
                "--color=no",
                "--timeout=300",
                "tests",
            ],
            args.timeout,
            MPIDIST_CUDA_AWARE=setting,
        )
        summary["steps"][f"tests ({mode})"] = {"rc": rc, "seconds": round(secs, 1), "summary": _summary_line(out)}
        if rc != 0:
            ok = False
            print(out[-6000:])

    rc, out, secs = _launch(args.ranks, ["-c", _BENCH, str(args.max_bytes), ",".join(modes)], args.timeout)
    rows = _result(out) if rc == 0 else None
    summary["steps"]["benchmark"] = {"rc": rc, "seconds": round(secs, 1), "rows": rows}
    if rows is None:
        ok = False
        print(out[-4000:])

    print(
        f"\n== mpidist GPU check: {summary['device']}, {args.ranks} ranks, {probe['gpus']} GPU(s) visible, "
        f"CuPy {probe['cupy']}, {probe['mpi']}"
    )
    print(
        f"transfer path with MPIDIST_CUDA_AWARE=auto: {'CUDA-aware' if probe['enabled'] else 'staged'} "
        f"({probe['reason']})"
    )
    for name, step in summary["steps"].items():
        if name.startswith("tests"):
            print(f"{name}: {'ok' if step['rc'] == 0 else 'FAILED'} - {step['summary']} ({step['seconds']} s)")
    if why_not:
        print(f"CUDA-aware numbers missing: {why_not}")
    if rows:
        print(f"{'mode':<11} {'size':>9} {'raw busbw':>10} {'mpidist':>10} {'mpidist/raw time':>17}")
        for row in rows:
            size = row["bytes"]
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(
                f"{row['mode']:<11} {label:>9} {row['raw_busbw_GBs']:>8.2f}GB/s {row['mpidist_busbw_GBs']:>8.2f}GB/s "
                f"{row['mpidist_s'] / row['raw_s']:>16.2f}x"
            )
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"summary written to {args.out}; {'all steps passed' if ok else 'SOME STEPS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
