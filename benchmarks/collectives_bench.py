"""mpidist's collectives against raw mpi4py and torch.distributed (gloo), in one run.

    mpiexec -n 2 python benchmarks/collectives_bench.py --out bench-results

The same as ``mpiexec -n 2 python -m mpidist bench``; see ``mpidist/_bench.py``
for the cases and ``docs/benchmarks.md`` for the latest results. Writes
``results.json``, ``results.md`` and ``busbw.png`` to ``--out``.
"""
import sys

from mpidist._tools.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
