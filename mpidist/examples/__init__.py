"""Runnable examples that ship with mpidist: ``python -m mpidist.examples.NAME``.

- :mod:`mpidist.examples.train_digits`: data-parallel training of a small MLP on the
  handwritten digits data, using every part of mpidist (the main job of ``jobs/train.sbatch``).
"""
