"""Where things are in the checkout, for the tests (imported as ``paths``: ``tests/helpers`` is on
pytest's ``pythonpath``), so that no test computes them from its own depth in the tree."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
REPO = TESTS.parent
SAMPLES = HELPERS / "samples"  # job scripts and pytest files that tests run (never collected)
STANDIN = HELPERS / "standin"  # the CPU stand-in for CuPy, imported as `cupy`
JOBS = REPO / "jobs"
CLUSTER = TESTS / "system" / "cluster"  # the test-cluster scripts (Slurm, namespace nodes)
