"""Rounding float32 to float16 on the host (mpidist._comm.half.Narrowing): NumPy's cast, bit for bit.

Every float16 value, the float32 midpoints between neighbours (where rounding to nearest even
decides) and one float32 step either side of them, the range's edges, zeros, subnormals,
infinities and a million random bit patterns, of both signs; NaN stays NaN (its payload is
not kept). Chunks of any length, and targets it does not handle (bfloat16, other array types)
take their own cast.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mpidist._comm.half import Narrowing


def cases() -> np.ndarray:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = np.unique(every[np.isfinite(every)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    edges = np.array(
        [65504, 65519.996, 65520, 65536, 1e6, 3e38, np.inf, 2**-14, 2**-24, 2**-25, 2**-25 * 1.0000001, 2**-26, 0.0],
        np.float32,
    )
    rng = np.random.default_rng(7)
    random = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    above = np.nextafter(mids, np.float32(np.inf))
    below = np.nextafter(mids, np.float32(-np.inf))
    x = np.concatenate([finite, mids, above, below, edges, random]).astype(np.float32)
    return np.concatenate([x, -x])


@pytest.mark.parametrize("chunk", [1 << 16, 1000])
def test_the_same_bits_as_numpys_cast(chunk):
    x = cases()
    out = np.empty(x.size, np.float16)
    Narrowing(chunk).into(out, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy warns of the overflows
        want = x.astype(np.float16)
    nan = np.isnan(want)
    assert np.isnan(out[nan]).all()
    differ = (out.view(np.uint16) != want.view(np.uint16)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} values differ, the first {x[differ][:3]}"


def test_pieces_and_other_targets():
    x = np.linspace(-70000, 70000, 5003, dtype=np.float32)
    narrowing = Narrowing(1024)
    out = np.full(x.size + 2, 7, np.float16)
    narrowing.into(out[1:-1], x)  # a view, several chunks and a ragged one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        np.testing.assert_array_equal(out[1:-1].view(np.uint16), x.astype(np.float16).view(np.uint16))
    assert out[0] == 7 and out[-1] == 7
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = np.empty(x.size, ml_dtypes.bfloat16)
    narrowing.into(b, x)  # bfloat16: ml_dtypes' own cast
    np.testing.assert_array_equal(b.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
