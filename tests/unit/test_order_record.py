"""The record of what fixes a dataset's order (serial): every rank reaches the same verdict from the sums alone."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist._comm.agreement import word_bits
from mpidist._input.order import (
    SLOTS,
    WORDS,
    decode_fields,
    describe_order,
    encode_fields,
    order_agreed,
    order_differences,
    order_record,
)

FIELDS = {"dataset": "array", "num_samples": 30, "global_batch_size": 6, "shuffle": 1, "seed": 4, "epoch": 0}


def verdicts(per_rank, failed=()):
    """Each rank's verdict on the SUM of every rank's record, as the allreduce would give it."""
    size = len(per_rank)
    records = [order_record(fields, r in failed, size) for r, fields in enumerate(per_rank)]
    sums = np.sum(records, axis=0)
    return sums, [order_agreed(sums, record, size) for record in records]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64, 1000, 4096, 2**20, 2**40])
def test_word_sums_stay_exact_in_float64(size):
    bits = word_bits(size)
    assert size * 2 ** (2 * bits) <= 2**52 or bits == 8
    assert bits >= 8 and WORDS * bits >= 24


def test_the_record_has_a_fixed_size_and_hashes_the_fields_whatever_their_order():
    record = order_record(FIELDS, False, 3)
    assert record.shape == (SLOTS,) and record.dtype == np.float64 and SLOTS == 1 + 2 * WORDS
    assert record[0] == 0 and order_record(FIELDS, True, 3)[0] == 1
    assert np.array_equal(order_record(dict(reversed(FIELDS.items())), False, 3), record)
    assert np.array_equal(record[2::2], record[1::2] ** 2)
    assert np.all(record[1::2] < 2 ** word_bits(3))
    assert not np.array_equal(order_record(dict(FIELDS, seed=5), False, 3), record)
    assert not np.any(order_record({}, False, 3))


@pytest.mark.parametrize("size", [2, 3, 7])
def test_equal_fields_agree_on_every_rank(size):
    sums, agreed = verdicts([FIELDS] * size)
    assert agreed == [True] * size and sums[0] == 0


@pytest.mark.parametrize("size", [2, 3, 7])
@pytest.mark.parametrize("field,value", [("seed", 5), ("epoch", 1), ("num_samples", 31), ("global_batch_size", 12)])
def test_one_rank_that_differs_is_seen_by_every_rank(size, field, value):
    per_rank = [FIELDS] * (size - 1) + [dict(FIELDS, **{field: value})]
    sums, agreed = verdicts(per_rank, failed=(0,))
    assert agreed == [False] * size  # the same verdict everywhere, without seeing the others' fields
    assert sums[0] == 1  # the failure count travels alongside


def test_verdicts_are_exact_at_thousands_of_ranks():
    """Many ranks with the largest words: the float64 sums are exact, so a single differing rank still shows."""
    size = 4096
    bits = word_bits(size)
    top = float(2**bits - 1)
    record = np.array([0.0] + [top, top * top] * WORDS)
    sums = np.zeros(SLOTS)
    for _ in range(size):
        sums += record
    assert order_agreed(sums, record, size)
    other = record.copy()
    other[1], other[2] = top - 1, (top - 1) ** 2
    assert not order_agreed(sums - record + other, record, size)


def test_differences_name_each_field_with_every_ranks_value():
    per_rank = [FIELDS, FIELDS, dict(FIELDS, seed=5, epoch=2)]
    assert order_differences(per_rank) == "epoch (ranks 0-1: 0; rank 2: 2), seed (ranks 0-1: 4; rank 2: 5)"
    assert order_differences([FIELDS, {"dataset": "elements"}]).startswith("dataset (rank 0: array; rank 1: elements)")
    assert "num_samples (rank 0: 30; rank 1: -)" in order_differences([FIELDS, {"dataset": "elements"}])
    assert order_differences([FIELDS, FIELDS]) == ""
    assert describe_order({"seed": 4, "dataset": "array"}) == "dataset=array, seed=4"


def test_fields_travel_as_text_and_back():
    assert decode_fields(encode_fields(FIELDS)) == FIELDS
    assert decode_fields(b"") == {}
    assert decode_fields(encode_fields({"seed": np.int64(3)})) == {"seed": "3"}  # never fails to encode
