"""Property-based checks: random shapes, dtypes, layouts and wrong types at the public API.

Each example gives either the right answer or a clear error, the same kind on
every rank, and never a hang. Under ``--with-mpi`` Hypothesis is derandomized
(see conftest.py), so every rank draws the same examples in the same order and
reaches the same collectives.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from mpi4py import MPI

import mpidist as md
from mpidist import CollectiveMismatchError
from mpidist._comm.communicator import Communicator
from mpidist._options import Options

pytestmark = pytest.mark.mpi

DTYPES = ["bool", "int8", "int32", "int64", "uint16", "float16", "float32", "float64", "complex64", "complex128"]
OPS = ["sum", "mean", "min", "max", "prod"]


@pytest.fixture(scope="module")
def comm():
    c = Communicator(MPI.COMM_WORLD, Options(piece_bytes=1024))
    yield c
    c.free()


@pytest.fixture(scope="module")
def strategy():
    s = md.MPIStrategy()
    yield s
    s.free()


def rank_values(rank: int, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    base = (np.arange(n) % 3 + rank + 1).reshape(shape)
    return (base % 2).astype(dtype) if dtype == "bool" else base.astype(dtype)


def expected_error(op: str, dtype: str, contiguous: bool):
    kind = np.dtype(dtype).kind
    if not contiguous:
        return TypeError
    if op == "mean" and kind in "iub":
        return ValueError
    if op in ("min", "max") and kind == "c":
        return ValueError
    return None


@settings(max_examples=60)
@given(
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    strided=st.booleans(),
)
def test_allreduce_right_answer_or_clear_error(comm, shape, dtype, op, strided):
    mine = rank_values(comm.rank, shape, dtype)
    if strided and mine.ndim and mine.shape[-1] > 1:
        mine = np.repeat(mine, 2, axis=-1)[..., ::2]  # same values, not contiguous
    error = expected_error(op, dtype, mine.flags.c_contiguous)
    if error is not None:
        with pytest.raises(error, match=f"rank {comm.rank}"):
            comm.allreduce(mine, op)
        return
    out = comm.allreduce(mine, op)
    stack = np.stack([rank_values(r, shape, dtype) for r in range(comm.size)])
    if dtype == "bool":
        want = stack.any(axis=0) if op in ("sum", "max") else stack.all(axis=0)
    elif op == "mean":
        want = stack.sum(axis=0, dtype=dtype) / comm.size
    else:
        want = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0).astype(dtype)
    assert out.shape == tuple(shape) and out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, want, rtol=2e-3 if dtype == "float16" else 1e-6)


@settings(max_examples=40)
@given(rows=st.lists(st.integers(0, 4), min_size=3, max_size=3), cols=st.integers(0, 3), dtype=st.sampled_from(DTYPES))
def test_allgather_unequal_rows(comm, rows, cols, dtype):
    counts = [rows[r % 3] for r in range(comm.size)]
    out = comm.allgather(rank_values(comm.rank, (counts[comm.rank], cols), dtype))
    want = np.concatenate([rank_values(r, (counts[r], cols), dtype) for r in range(comm.size)])
    np.testing.assert_array_equal(out, want)


@settings(max_examples=30)
@given(extra=st.integers(1, 3), dtype=st.sampled_from(["float32", "int64"]))
def test_shape_disagreement_is_reported_everywhere(comm, extra, dtype):
    if comm.size == 1:
        return
    mine = np.zeros(2 + (extra if comm.rank == comm.size - 1 else 0), dtype=dtype)
    with pytest.raises(CollectiveMismatchError, match=f"{np.dtype(dtype).name}\\[{2 + extra}\\]"):
        comm.allreduce(mine)


WRONG = [None, "text", object(), {"a": object()}, [object()], b"bytes"]


@settings(max_examples=20)
@given(value=st.sampled_from(WRONG), op=st.sampled_from(["sum", "mean"]))
def test_wrong_types_at_the_strategy_give_clear_errors(strategy, value, op):
    with pytest.raises((TypeError, ValueError)) as info:
        strategy.reduce(op, value)
    assert "rank" in str(info.value) or "array" in str(info.value) or "dtype" in str(info.value)
    with pytest.raises(ValueError, match="unknown reduce op"):
        strategy.reduce("median", np.ones(2))
