"""The mirror fingerprint that ``check_mirrored`` and ``Checkpoint.save`` compare across ranks (serial)."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist._comm.backend import host_bytes
from mpidist._distribute import mirrors
from mpidist._distribute.mirrors import describe, diverged, fingerprint


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(mirrors, "_CRC_SPAN_BYTES", 64)  # many spans from small arrays


@pytest.mark.parametrize("threads", [1, 3])
def test_equal_bytes_give_equal_fingerprints_whatever_the_threads(small_pieces, threads):
    a = np.arange(1000, dtype=np.float64)
    assert fingerprint(a, threads) == fingerprint(a.copy(), 1)
    assert fingerprint(a.reshape(10, 100), threads) == fingerprint(a, threads)


@pytest.mark.parametrize("at", [0, 63, 64, 7999])
def test_one_changed_byte_in_any_piece_changes_the_fingerprint(small_pieces, at):
    a = np.zeros(8000, dtype=np.uint8)
    b = a.copy()
    b[at] = 1
    assert fingerprint(a, 2) != fingerprint(b, 2)


def test_empty_and_zero_dimensional_arrays():
    assert fingerprint(np.zeros(0)) == fingerprint(np.zeros((0, 3)))
    assert fingerprint(np.array(1.5)) == fingerprint(np.array([1.5]))
    assert fingerprint(np.array(1.5)) != fingerprint(np.array(2.5))


def test_host_bytes_are_the_arrays_bytes():
    a = np.arange(10, dtype=np.int32)
    assert host_bytes(a, 8, 20).tobytes() == a.tobytes()[8:20]


def test_diverged_names_the_ranks_that_differ_from_rank_0():
    names = ["w", "b", "c"]
    table = [[1, 2, 3], [1, 5, 3], [1, 5, 4]]
    assert diverged(names, table) == {"b": (1, 2), "c": (2,)}
    assert diverged(names, [[1, 2, 3]]) == {}
    assert diverged([], [[], []]) == {}


def test_describe_names_each_variable_and_its_ranks():
    assert describe({"b": (1, 2), "c": (2,)}) == (
        "mirrored variable 'b' differs from rank 0's on ranks 1-2; "
        "mirrored variable 'c' differs from rank 0's on rank 2"
    )
