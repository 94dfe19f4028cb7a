"""What fixes a distributed dataset's order, as the small record the ranks agree on when an epoch starts.

Which sample (or record) each rank reads at each step follows from a few
values that every rank must pass alike: the kind of dataset and its
sharding, its length (samples or files), its global batch size and
remainder, whether it shuffles, the seed, the epoch and the position. The
iterator of :mod:`mpidist._input.distributed` collects them as *fields*
(a dict of names to ints and strings) and adds them to the one exchange that
starts each epoch: a ``SUM`` allreduce of :data:`SLOTS` ``float64`` values,

- slot 0: 1 if this rank's source failed to open, else 0 (the sum counts
  the failed ranks);
- then :data:`WORDS` hash words ``h`` of the fields, each next to ``h**2``.

As in the communicator's agreement, all ranks sent the same word ``h``
exactly when ``sum(h) == N*h`` and ``sum(h**2) == N*h**2``, which each rank
checks against its own words, so every rank reaches the same verdict
without seeing the others' fields. Words have ``b`` bits with
``N * 2**(2b) <= 2**52``, so the float64 sums are exact in any order (and
the record travels inside the agreement record, in the same MPI call). Only
when the verdict is "they differ" do the ranks exchange their fields, to
name what differs, each rank's value and the ranks (:func:`order_differences`).

Everything here is local.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np

from mpidist._comm.agreement import word_bits
from mpidist._comm.outcome import group_ranks

__all__ = [
    "SLOTS",
    "WORDS",
    "Fields",
    "decode_fields",
    "describe_order",
    "encode_fields",
    "order_agreed",
    "order_differences",
    "order_record",
]

Fields = Mapping[str, Union[int, str]]

WORDS = 3  # hash words: two sets of fields that differ give the same words with probability 2**(-3b)
SLOTS = 1 + 2 * WORDS


def order_record(fields: Fields, failed: bool, size: int) -> np.ndarray:
    """This rank's record: ``[failed, h_0, h_0**2, ..., h_{WORDS-1}, h_{WORDS-1}**2]`` as ``float64``.

    The words hash ``fields`` whatever the order of their keys; no fields
    (``{}``) give zero words, which agree with any other rank's zero words.
    """
    record = np.zeros(SLOTS)
    record[0] = 1.0 if failed else 0.0
    if fields:
        bits = word_bits(size)
        digest = hashlib.blake2b(_canonical(fields).encode(), digest_size=16).digest()
        value = int.from_bytes(digest, "little")
        words = np.array([(value >> (k * bits)) & ((1 << bits) - 1) for k in range(WORDS)], dtype=np.float64)
        record[1::2] = words
        record[2::2] = words * words
    return record


def order_agreed(sums: np.ndarray, record: np.ndarray, size: int) -> bool:
    """Whether every rank sent this rank's words, from the summed records (the same verdict on every rank)."""
    return bool(np.array_equal(sums[1:], size * record[1:]))


def describe_order(fields: Fields) -> str:
    """``"dataset=array, epoch=0, seed=3"``: the fields in one line, keys sorted."""
    return ", ".join(f"{key}={fields[key]}" for key in sorted(fields))


def order_differences(per_rank: Sequence[Fields]) -> str:
    """The fields whose values differ between ranks, each with every rank's value (ranks grouped).

    ``"seed (ranks 0-1: 3; rank 2: 4), epoch (...)"``; a field a rank lacks is
    written ``-``.
    """
    keys = sorted({key for fields in per_rank for key in fields})
    parts = []
    for key in keys:
        column = {r: str(fields.get(key, "-")) for r, fields in enumerate(per_rank)}
        if len(set(column.values())) > 1:
            parts.append(f"{key} ({group_ranks(column, things='values')})")
    return ", ".join(parts)


def encode_fields(fields: Fields) -> bytes:
    """``fields`` as the bytes a rank sends when the ranks disagree (read back by :func:`decode_fields`)."""
    return _canonical(fields).encode()


def decode_fields(data: bytes) -> Fields:
    """Another rank's fields, from :func:`encode_fields`; ``{}`` when there are none."""
    decoded = json.loads(data.decode()) if data else {}
    return decoded if isinstance(decoded, dict) else {}


def _canonical(fields: Fields) -> str:
    return json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), default=str)  # never fails
