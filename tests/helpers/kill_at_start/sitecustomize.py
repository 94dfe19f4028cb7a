"""Installs ``kill_at``'s hook as every Python starts, for programs that a script starts (``jobs/train.sbatch``).

Python imports ``sitecustomize`` at start-up from its path: with this folder and ``tests/helpers`` on
``PYTHONPATH`` and ``MPIDIST_TEST_KILL`` set, the ranks of ``python -m mpidist.examples.train_digits``
kill themselves where ``kill_at`` says, although the batch script runs the program as a user would.
A Slurm job's runs after a requeue (``SLURM_RESTART_COUNT`` above 0) are left alone: the kill is the
first run's.
"""

import os

if os.environ.get("MPIDIST_TEST_KILL") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    import kill_at

    kill_at.install()
