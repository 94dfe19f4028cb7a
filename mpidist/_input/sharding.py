"""Sharding arithmetic: which samples, elements and files each rank reads, as pure functions.

Everything here depends on its arguments alone, ``(num_samples, rank, size,
...)``: no MPI, no state, the same answer on every rank. The input pipeline
(:mod:`mpidist._input.datasets`, :mod:`mpidist._input.sources`) is built on
these functions, and they are tested serially over many ``(rank, size)`` pairs.

Vocabulary: an epoch visits the samples in an *order* (:func:`epoch_order`);
a *position* is an index into that order; the *offset* is the number of
positions consumed so far, over all ranks, so it means the same at any
number of ranks.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

from mpidist._errors import on_rank

__all__ = [
    "REMAINDERS",
    "SHARD_POLICIES",
    "batch_plan",
    "batch_rows",
    "check_count",
    "check_rank",
    "check_remainder",
    "choose_shard_policy",
    "epoch_order",
    "file_shard",
    "num_steps",
    "per_replica_batch_size",
]

REMAINDERS = ("drop", "partial", "mask")
SHARD_POLICIES = ("auto", "file", "element")


def check_count(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an ``int`` >= ``minimum``, or a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_rank(rank: int, size: int) -> None:
    """``ValueError`` unless ``0 <= rank < size`` (and ``size >= 1``)."""
    check_count("size", size, 1)
    if check_count("rank", rank) >= size:
        raise ValueError(f"rank must be < {size} (the number of ranks), got {rank}")


def _split(count: int, rank: int, size: int) -> tuple[int, int]:
    base, extra = divmod(count, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def per_replica_batch_size(global_batch_size: int, num_replicas: int, rank: Optional[int] = None) -> int:
    """``global_batch_size / num_replicas``; ``ValueError`` (naming both) unless it divides evenly."""
    batch = check_count("global_batch_size", global_batch_size, 1)
    replicas = check_count("num_replicas", num_replicas, 1)
    if batch % replicas:
        lower, upper = batch - batch % replicas, batch + replicas - batch % replicas
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        message = (
            f"global batch size {batch} is not divisible by the {replicas} replicas; "
            f"use a multiple of {replicas} (e.g. {hint})"
        )
        raise ValueError(message if rank is None else on_rank(rank, message))
    return batch // replicas


def num_steps(num_samples: int, global_batch_size: int, offset: int = 0, remainder: str = "drop") -> int:
    """Steps left in an epoch of ``num_samples`` read in global batches from sample ``offset``.

    ``remainder="drop"`` counts full batches only; ``"partial"`` and ``"mask"``
    count a last, smaller batch too.
    """
    check_remainder(remainder)
    left = max(0, check_count("num_samples", num_samples) - check_count("offset", offset))
    batch = check_count("global_batch_size", global_batch_size, 1)
    return left // batch if remainder == "drop" else -(-left // batch)


def _rows(offset: int, num_samples: int, batch: int, rank: int, size: int, auto_shard: bool) -> tuple[int, int]:
    count = max(0, min(batch, num_samples - offset))
    if not auto_shard:
        return offset, offset + count
    lo, hi = _split(count, rank, size)
    return offset + lo, offset + hi


def batch_rows(
    offset: int, num_samples: int, global_batch_size: int, rank: int, size: int, auto_shard: bool = True
) -> tuple[int, int]:
    """Positions ``[lo, hi)`` (in the epoch's sample order) rank reads at the step starting at ``offset``.

    The step holds ``min(B, num_samples - offset)`` samples; with
    ``auto_shard`` they are split as evenly as possible, lower ranks first
    (``B / N`` each for a full batch), without it every rank reads all of them.
    """
    check_rank(rank, size)
    return _rows(
        check_count("offset", offset),
        check_count("num_samples", num_samples),
        check_count("global_batch_size", global_batch_size, 1),
        rank,
        size,
        auto_shard,
    )


def batch_plan(
    num_samples: int,
    global_batch_size: int,
    rank: int,
    size: int,
    *,
    offset: int = 0,
    remainder: str = "drop",
    auto_shard: bool = True,
) -> Iterator[tuple[int, int, int]]:
    """``(lo, hi, advance)`` for each step left from global sample ``offset``: :func:`batch_rows` and
    the number of samples the step consumes over all ranks (the offset moves by ``advance``).

    The arguments are checked once, when the generator is created.
    """
    steps = num_steps(num_samples, global_batch_size, offset, remainder)
    check_rank(rank, size)
    return _plan(num_samples, global_batch_size, rank, size, offset, steps, auto_shard)


def _plan(
    num_samples: int, batch: int, rank: int, size: int, offset: int, steps: int, auto_shard: bool
) -> Iterator[tuple[int, int, int]]:
    for _ in range(steps):
        lo, hi = _rows(offset, num_samples, batch, rank, size, auto_shard)
        advance = min(batch, num_samples - offset)
        yield lo, hi, advance
        offset += advance


def epoch_order(num_samples: int, epoch: int = 0, seed: int = 0, shuffle: bool = True) -> np.ndarray:
    """The order in which an epoch visits the samples: the same on every rank, without communication.

    A permutation drawn from ``numpy.random.default_rng([seed, epoch])`` when
    ``shuffle``, else ``arange(num_samples)``.
    """
    n = check_count("num_samples", num_samples)
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([check_count("seed", seed), check_count("epoch", epoch)]).permutation(n)


def choose_shard_policy(num_files: int, size: int, policy: str = "auto") -> str:
    """``"file"`` or ``"element"``: how ``num_files`` files are shared out over ``size`` ranks.

    ``"auto"`` picks ``"file"`` when every rank gets at least one file.
    """
    if policy not in SHARD_POLICIES:
        raise ValueError(f"shard_policy must be one of {', '.join(SHARD_POLICIES)}, got {policy!r}")
    if policy == "auto":
        return "file" if num_files >= size else "element"
    if policy == "file" and num_files < size:
        raise ValueError(
            f"shard_policy='file' needs at least one file per rank: {num_files} files for {size} "
            "ranks; use shard_policy='element' (or 'auto'), or split the data into more files"
        )
    return policy


def file_shard(num_files: int, rank: int, size: int) -> list[int]:
    """Indices of the files rank reads when sharding by file: ``rank, rank + size, ...``."""
    check_rank(rank, size)
    return list(range(rank, check_count("num_files", num_files), size))


def check_remainder(remainder: str) -> None:
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {', '.join(REMAINDERS)}, got {remainder!r}")
