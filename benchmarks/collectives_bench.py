"""mpidist's collectives against raw mpi4py and torch.distributed (gloo), in one run.

    mpiexec -n 2 python benchmarks/collectives_bench.py --out bench-results
    python benchmarks/goals.py bench-results/results.json

The same as ``mpiexec -n 2 python -m mpidist bench``; see
``mpidist/_tools/bench.py`` for the cases, ``benchmarks/goals.py`` for the
goals the ratios are compared with, and ``docs/benchmarks.md`` for the latest
results. Writes ``results.json``, ``results.md`` and ``busbw.png`` to ``--out``.
"""

import sys

from mpidist._tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
