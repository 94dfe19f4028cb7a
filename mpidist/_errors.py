"""mpidist's exception hierarchy.

Every error mpidist raises on purpose derives from :class:`MpidistError`, and
also from the built-in type a Python user would expect (``ValueError`` for bad
input, ``RuntimeError`` for a failure of the run), so both ``except`` styles
work. Errors coming out of MPI are translated into :class:`CommError` with
``raise ... from`` so the original MPI error stays attached.
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = [
    "MpidistError",
    "CheckpointError",
    "ChecksumError",
    "CommError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "MirrorDivergenceError",
    "NonFiniteError",
]


class MpidistError(Exception):
    """Base class of every exception mpidist raises on purpose."""


class CommError(MpidistError, RuntimeError):
    """An MPI call failed; the MPI error is chained as ``__cause__``."""


class CollectiveMismatchError(MpidistError, ValueError):
    """Ranks entered the same collective with incompatible arguments.

    Raised on every rank of the communicator, before any data moved, so no
    array was modified. ``records`` maps each rank to a description of what it
    passed (operation, shape, dtype, reduce op).
    """

    def __init__(self, message: str, records: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.records = dict(records or {})


class CollectiveTimeoutError(MpidistError, RuntimeError):
    """Some ranks did not join a collective within the configured timeout.

    ``missing_ranks`` lists the ranks (of the communicator) that did not
    arrive. The communicator is unusable afterwards: the collective it was
    waiting for can no longer complete consistently.
    """

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)


class NonFiniteError(MpidistError, FloatingPointError):
    """A reduction was refused because some ranks contributed NaN or Inf.

    Raised on every rank (with ``check_finite`` on) before any data moved.
    ``ranks`` lists the ranks whose contribution was not finite.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class MirrorDivergenceError(MpidistError, RuntimeError):
    """Components of a mirrored variable differ between ranks.

    ``diverged`` maps each variable name to the ranks whose component differs
    from rank 0's.
    """

    def __init__(self, message: str, diverged: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__(message)
        self.diverged = dict(diverged or {})


class CheckpointError(MpidistError, RuntimeError):
    """A checkpoint could not be saved or restored (I/O error, unusable directory).

    Collective operations raise it on every rank; the message names the ranks
    that failed and why, and on those ranks the original error is chained as
    ``__cause__``.
    """


class ChecksumError(CheckpointError):
    """A checkpoint file does not match the checksum or size recorded when it was written.

    The file was truncated, altered or damaged after the save. ``file`` is the
    damaged file and ``entry`` the name of the item stored in it (``None``
    for the manifest).
    """

    def __init__(self, message: str, file: str | None = None, entry: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.entry = entry


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: compact rank lists for messages."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)
