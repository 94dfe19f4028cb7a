"""Mirror fingerprints: how ranks check that a mirrored variable's components are identical.

A fingerprint is a CRC-32 of the CRC-32s of an array's bytes, taken in spans
of 8 MiB (a device array is copied to the host one span at a time, so the
check never needs a host copy of the whole array). Ranks compare their
fingerprints with rank 0's: :meth:`MPIStrategy.check_mirrored
<mpidist.MPIStrategy.check_mirrored>` and ``Checkpoint.save`` (with
``check_mirrors``) both use the functions here. Everything in this module is
local.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from mpidist._comm.backend import host_bytes
from mpidist._errors import format_ranks

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from mpidist._typing import Array

__all__ = ["describe", "diverged", "fingerprint"]

# Bytes of each checksum of a fingerprint, and of each device-to-host copy it makes.
_CRC_SPAN_BYTES = 8 << 20


def fingerprint(value: Array, threads: int = 1) -> int:
    """Local: the CRC-32 of the CRC-32s of every span of array ``value``'s bytes (spans on ``threads`` threads)."""
    nbytes = int(value.nbytes)

    def crc(lo: int) -> int:
        return zlib.crc32(host_bytes(value, lo, min(lo + _CRC_SPAN_BYTES, nbytes)).data)

    starts = range(0, nbytes, _CRC_SPAN_BYTES)
    if threads <= 1 or len(starts) <= 1:
        crcs = [crc(lo) for lo in starts]
    else:  # zlib releases the GIL
        with ThreadPoolExecutor(max_workers=min(threads, len(starts))) as pool:
            crcs = list(pool.map(crc, starts))
    return zlib.crc32(np.array(crcs, np.uint32).tobytes())


def diverged(names: Sequence[str], table: ArrayLike) -> dict[str, tuple[int, ...]]:
    """Local: ``{name: ranks whose fingerprint differs from rank 0's}`` for the names that differ anywhere.

    ``table[r][i]`` is rank ``r``'s fingerprint of ``names[i]``; every rank
    passes the same table, so all find the same answer.
    """
    fingerprints = np.asarray(table, dtype=np.int64)
    differ = fingerprints != fingerprints[0]
    return {
        name: tuple(int(r) for r in np.nonzero(differ[:, i])[0]) for i, name in enumerate(names) if differ[:, i].any()
    }


def describe(differ: Mapping[str, Sequence[int]]) -> str:
    """Local: what :func:`diverged` found, in words (the one wording of the mirror checks' errors).

    ``{"w": (1, 2, 3)}`` -> ``"mirrored variable 'w' differs from rank 0's on ranks 1-3"``; entries joined by ``"; "``.
    """
    return "; ".join(
        f"mirrored variable {name!r} differs from rank 0's on rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"
        for name, ranks in differ.items()
    )
