"""Mirror fingerprints: how ranks check that a mirrored variable's components are identical.

A fingerprint is a CRC-32 of the CRC-32s of an array's bytes, taken in pieces
of :data:`PIECE_BYTES` (a device array is copied to the host one piece at a
time, so the check never needs a host copy of the whole array). Ranks compare
their fingerprints with rank 0's: :meth:`MPIStrategy.check_mirrored
<mpidist.MPIStrategy.check_mirrored>` and ``Checkpoint.save`` (with
``check_mirrors``) both use the functions here. Everything in this module is
local.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from mpidist._comm.backend import to_host

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from mpidist._typing import Array

__all__ = ["PIECE_BYTES", "diverged", "fingerprint", "host_bytes"]

# Unit of the checksums (and of the device-to-host copies) of a fingerprint.
PIECE_BYTES = 8 << 20


def host_bytes(value: Array, lo: int, hi: int) -> np.ndarray:
    """Local: bytes ``[lo, hi)`` of array ``value`` (NumPy or a device array) as a host ``uint8`` array."""
    itemsize = value.dtype.itemsize
    part = to_host(value.reshape(-1)[lo // itemsize : hi // itemsize])
    return np.ascontiguousarray(part).view(np.uint8)


def fingerprint(value: Array, threads: int = 1) -> int:
    """Local: the CRC-32 of the CRC-32s of every piece of array ``value``'s bytes (pieces on ``threads`` threads)."""
    nbytes = int(value.nbytes)

    def crc(lo: int) -> int:
        return zlib.crc32(host_bytes(value, lo, min(lo + PIECE_BYTES, nbytes)).data)

    starts = range(0, nbytes, PIECE_BYTES)
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
