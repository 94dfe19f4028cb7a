"""Exact evaluation metrics on sync-on-read variables: :class:`Sum`, :class:`Mean`, :class:`Accuracy`.

Each replica accumulates its own samples into a :class:`~mpidist.SyncOnReadVariable`
(local); :meth:`result` sums the replicas' states (collective) and returns a
float. The sums are *exact*: every value is added into a fixed-point integer
that spans the whole float64 range (the accumulator is a row of int64
"limbs" of 32 bits each, lowest bit ``2**-1074``), integer sums do not
depend on order, and the result is the exact total rounded once. So a
metric over the same samples gives the same float, bit for bit, at 1, 2 or
3 ranks and however the samples were batched, as long as every sample is
read exactly once (``ArrayDataset(..., remainder="partial")`` or
``"mask"`` with the mask as ``sample_weight``).

Cost: one small host computation per update (device arrays are copied to
the host), one allreduce of ``rows x 73`` int64 per :meth:`result`.
"""

from __future__ import annotations

import fractions
import math
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import numpy as np

from mpidist._comm.backend import to_host
from mpidist._distribute.context import get_replica_context, require_strategy
from mpidist._distribute.variables import SyncOnReadVariable, Variable, VariableAggregation, VariableSynchronization
from mpidist._errors import on_rank
from mpidist._values.values import DistributedValues

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from mpidist._typing import Array

    Values = Union[Array, ArrayLike]  # an array (NumPy, CuPy, a distributed value), or what numpy.asarray takes

__all__ = ["Accuracy", "Mean", "Sum", "exact_decode", "exact_encode", "exact_sum"]

_BITS = 32
_MASK = (1 << _BITS) - 1
_LOW = 1074  # the accumulator's lowest bit is 2**-1074, float64's smallest subnormal
_LIMBS = 70  # bits 2**-1074 .. 2**1166: float64's range and 2**142 of headroom for the count of values
_NAN, _POSINF, _NEGINF = _LIMBS, _LIMBS + 1, _LIMBS + 2
WIDTH = _LIMBS + 3  # limbs, then the counts of NaN, +inf and -inf


def exact_sum(values: Values) -> np.ndarray:
    """The exact sum of ``values`` (converted to float64) as an accumulator row of ``WIDTH`` int64. Local.

    The limbs may be unnormalised (any int64); :func:`exact_decode` and
    :func:`exact_encode` read and write them.
    """
    x = np.asarray(to_host(values), dtype=np.float64).ravel()
    row = np.zeros(WIDTH, dtype=np.int64)
    finite = np.isfinite(x)
    if not finite.all():
        row[_NAN] = np.isnan(x).sum()
        row[_POSINF] = (x == np.inf).sum()
        row[_NEGINF] = (x == -np.inf).sum()
        x = x[finite]
    fraction, exponent = np.frexp(x)  # x = fraction * 2**exponent, 0.5 <= |fraction| < 1
    mantissa = (fraction * 2.0**53).astype(np.int64)  # exact: |mantissa| < 2**53
    position = exponent.astype(np.int64) - 53 + _LOW  # bit position of the mantissa's lowest bit
    magnitude = np.abs(mantissa)
    below = position < 0  # subnormals: the bits shifted out are zeros
    magnitude[below] >>= -position[below]
    position[below] = 0
    sign = np.sign(mantissa)
    limb, shift = np.divmod(position, _BITS)
    low = (magnitude & _MASK) << shift  # < 2**63
    high = (magnitude >> _BITS) << shift  # < 2**52
    for offset, part in ((0, low & _MASK), (1, low >> _BITS), (1, high & _MASK), (2, high >> _BITS)):
        np.add.at(row, limb + offset, sign * part)
    return row


def exact_decode(row: np.ndarray) -> tuple[int, int, int, int]:
    """``(total, nan, posinf, neginf)``: the finite sum as an integer multiple of ``2**-1074``, and counts."""
    total = sum(int(v) << (_BITS * i) for i, v in enumerate(row[:_LIMBS].tolist()))
    return total, int(row[_NAN]), int(row[_POSINF]), int(row[_NEGINF])


def exact_encode(total: int, nan: int = 0, posinf: int = 0, neginf: int = 0) -> np.ndarray:
    """An accumulator row holding ``total`` (a multiple of ``2**-1074``) with normalised limbs."""
    row = np.zeros(WIDTH, dtype=np.int64)
    for i in range(_LIMBS - 1):
        row[i] = (total >> (_BITS * i)) & _MASK
    row[_LIMBS - 1] = total >> (_BITS * (_LIMBS - 1))  # the top limb keeps the sign
    row[_NAN], row[_POSINF], row[_NEGINF] = nan, posinf, neginf
    return row


def _as_float(row: np.ndarray, divisor: Optional[fractions.Fraction] = None) -> float:
    """The accumulated value (divided by ``divisor``, itself in units of ``2**-1074``), rounded once."""
    total, nan, posinf, neginf = exact_decode(row)
    if nan or (posinf and neginf):
        return math.nan
    if posinf or neginf:
        return math.inf if posinf else -math.inf
    value = fractions.Fraction(total, 1 << _LOW) if divisor is None else fractions.Fraction(total) / divisor
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _local(x: Any) -> Any:
    return x.get() if isinstance(x, DistributedValues) else x


class _ExactMetric:
    """A metric whose state is ``rows`` exact accumulators in one sync-on-read variable.

    Creation is collective (a variable is created): call it on every rank,
    inside ``strategy.scope()``.
    """

    _rows = 1

    def __init__(self, name: Optional[str] = None) -> None:
        self._strategy = require_strategy(f"{type(self).__name__}(...)")
        self.name = name or type(self).__name__.lower()
        self._state = Variable(
            np.zeros((self._rows, WIDTH), dtype=np.int64),
            name=self.name,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=VariableAggregation.SUM,
        )

    @property
    def variables(self) -> tuple:
        """The metric's state variables (for checkpoints)."""
        return (self._state,)

    def _add(self, rows: np.ndarray) -> None:
        """Add ``rows`` (one accumulator row per state row) to this replica's component. Local."""
        if get_replica_context() is None:
            self._strategy.run(self._add, args=(rows,))
            return
        current = to_host(self._state.read_value())
        updated = [
            exact_encode(*(a + b for a, b in zip(exact_decode(current[i]), exact_decode(rows[i]))))
            for i in range(self._rows)
        ]
        self._state.assign(np.stack(updated))

    def _read(self) -> np.ndarray:
        """Collective: the state summed over all replicas (host int64)."""
        if get_replica_context() is not None:
            raise RuntimeError(
                f"{type(self).__name__}.result() is collective: call it outside strategy.run, on every rank"
            )
        return to_host(self._strategy.read_var(self._state))

    def reset_state(self) -> None:
        """Forget all samples. Local; call it on every rank."""
        cast(
            SyncOnReadVariable, self._state
        ).lost_ranks = ()  # counted afresh: the parts of ranks that died no longer matter
        zeros = np.zeros((self._rows, WIDTH), dtype=np.int64)
        if get_replica_context() is not None:
            self._state.assign(zeros)
        else:
            with self._strategy.scope():
                self._state.assign(zeros)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} rank {self._strategy.rank}>"


class Sum(_ExactMetric):
    """The exact sum of all values seen by all replicas.

    ``update_state(values, sample_weight=None)`` is local (in or outside
    ``strategy.run``); ``result()`` is collective.
    """

    def update_state(self, values: Values, sample_weight: Optional[Values] = None) -> None:
        """Add ``values`` (times ``sample_weight``, broadcast to their shape). Local."""
        values, weights = _weighted(values, sample_weight)
        self._add(exact_sum(values if weights is None else values * weights)[None])

    def result(self) -> float:
        """Collective: the sum over all replicas, correctly rounded to float64."""
        return _as_float(self._read()[0])


class Mean(_ExactMetric):
    """The exact (weighted) mean of all values seen by all replicas: total / count.

    ``update_state(values, sample_weight=None)`` is local; ``result()`` is
    collective and returns 0.0 before any sample (as Keras does).
    Samples of weight 0 (masked padding) are skipped, whatever their value.
    """

    _rows = 2

    def update_state(self, values: Values, sample_weight: Optional[Values] = None) -> None:
        """Add ``values`` with weights ``sample_weight`` (default 1, broadcast to their shape). Local."""
        values, weights = _weighted(values, sample_weight)
        count = exact_sum(np.ones(values.size) if weights is None else weights)
        self._add(np.stack([exact_sum(values if weights is None else values * weights), count]))

    def result(self) -> float:
        """Collective: the mean over all replicas, correctly rounded to float64."""
        state = self._read()
        count, *special = exact_decode(state[1])
        if any(special):
            return math.nan
        return 0.0 if count == 0 else _as_float(state[0], fractions.Fraction(count))


class Accuracy(Mean):
    """The fraction of predictions that equal their labels, over all replicas.

    ``update_state(y_true, y_pred, sample_weight=None)``: ``y_pred`` with one
    more dimension than ``y_true`` holds class scores (its argmax over the
    last axis is compared); otherwise values are compared directly. Local.
    """

    def update_state(  # type: ignore[override]
        self, y_true: Values, y_pred: Values, sample_weight: Optional[Values] = None
    ) -> None:
        true = np.asarray(to_host(_local(y_true)))
        pred = np.asarray(to_host(_local(y_pred)))
        if pred.ndim == true.ndim + 1:
            pred = pred.argmax(axis=-1)
        if pred.shape != true.shape:
            raise ValueError(
                on_rank(
                    self._strategy.rank,
                    f"{type(self).__name__}.update_state: y_pred of shape "
                    f"{pred.shape} does not match y_true of shape {true.shape} (pass class scores "
                    "with one extra last axis, or predictions of y_true's shape)",
                )
            )
        super().update_state((pred == true).astype(np.float64), sample_weight)


def _weighted(values: Values, sample_weight: Optional[Values]) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Host float64 ``values`` and weights of their shape, without the weight-0 entries. Local."""
    x = np.asarray(to_host(_local(values)), dtype=np.float64)
    if sample_weight is None:
        return x.ravel(), None
    w = np.asarray(to_host(_local(sample_weight)), dtype=np.float64)
    try:
        w = np.broadcast_to(w.reshape(w.shape + (1,) * (x.ndim - w.ndim)) if w.ndim < x.ndim else w, x.shape)
    except ValueError:
        raise ValueError(
            f"sample_weight of shape {w.shape} does not broadcast to the values' shape {x.shape}"
        ) from None
    keep = w.ravel() != 0
    return x.ravel()[keep], w.ravel()[keep]
