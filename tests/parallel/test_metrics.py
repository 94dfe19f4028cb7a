"""Exact metrics under mpiexec (1, 2 and 3 ranks): samples of weight 0 are skipped, whatever their value.

Users mask samples (padding, NaN labels) with weight 0; ``Mean`` and ``Sum`` promise to skip
them, so a NaN or an infinity of weight 0 must not reach the result. Expected values derive
from rank and size; each update is made in replica context (``strategy.run``) and outside it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpidist._distribute.metrics import Accuracy, Mean, Sum
from mpidist._distribute.strategy import MPIStrategy

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def strategy():
    s = MPIStrategy(timeout=30)
    yield s
    s.free()


def update(strategy, metric, *args, replica):
    """``metric.update_state(*args)`` on every rank, in replica context or outside it."""
    if replica:
        strategy.run(lambda: metric.update_state(*args))
    else:
        metric.update_state(*args)


@pytest.mark.parametrize("replica", [True, False], ids=["replica", "cross-replica"])
def test_the_docstring_example_at_any_number_of_ranks(strategy, replica):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        mean, total = Mean(), Sum()
    for _ in range(2):  # the second round: reset_state forgets the first
        for metric in (mean, total):
            update(strategy, metric, [1.0, 3.0, math.nan], [1, 1, 0], replica=replica)
        assert (mean.result(), total.result()) == (2.0, 4.0 * n)
        mean.reset_state()
        total.reset_state()


@pytest.mark.parametrize("replica", [True, False], ids=["replica", "cross-replica"])
@pytest.mark.parametrize("masked", [math.nan, math.inf, -math.inf, 1e308])
def test_samples_of_weight_0_are_skipped_whatever_their_value(strategy, replica, masked):
    """Rank r adds r + 1 and r + 3 of weight 1, r + 2 of weight 2, and ``masked`` of weight 0 (also -0.0)."""
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        mean, total = Mean(), Sum()
    values = np.array([r + 1, masked, r + 3, r + 2, masked])
    weights = np.array([1, 0, 1, 2, -0.0])
    for metric in (mean, total):
        update(strategy, metric, values, weights, replica=replica)
    weighted = sum(4 * q + 8 for q in range(n))  # (q + 1) + (q + 3) + 2 (q + 2) over the ranks q
    assert total.result() == weighted
    assert mean.result() == weighted / (4 * n)  # exact: the weights add up to 4 per rank


def test_a_boolean_mask_over_rows_skips_the_padding_rows(strategy):
    """A ``remainder="mask"`` mask as ``sample_weight``: one weight per row of a 2-d batch."""
    n, r = strategy.num_replicas_in_sync, strategy.rank
    with strategy.scope():
        mean, total, accuracy = Mean(), Sum(), Accuracy()
    rows = np.array([[r, r + 1.0], [math.nan, math.inf], [2.0 * r, 1.0]])
    mask = np.array([True, False, r % 2 == 0])
    labels, scores = np.array([0, 1, 2]), np.array([[1.0, 0.0, 0.0], [math.nan] * 3, [0.0, 1.0, 0.0]])

    def step():
        mean.update_state(rows, sample_weight=mask)
        total.update_state(rows, sample_weight=mask)
        accuracy.update_state(labels, scores, sample_weight=mask)

    strategy.run(step)
    kept = [(q, q + 1.0) + ((2.0 * q, 1.0) if q % 2 == 0 else ()) for q in range(n)]
    assert total.result() == sum(map(sum, kept))
    assert mean.result() == sum(map(sum, kept)) / sum(map(len, kept))
    # row 0 right, row 2 wrong (its argmax is 1, its label 2), row 1 (NaN scores) masked everywhere
    assert accuracy.result() == n / (n + (n + 1) // 2)


def test_all_samples_of_weight_0_leave_the_metrics_empty(strategy):
    with strategy.scope():
        mean, total = Mean(), Sum()
    for metric in (mean, total):
        update(strategy, metric, [math.nan, math.inf], [0, 0], replica=True)
    assert (mean.result(), total.result()) == (0.0, 0.0)  # Mean before any sample is 0.0, as in Keras
