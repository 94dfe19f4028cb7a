"""mpidist's exception hierarchy.

Every error mpidist raises on purpose derives from :class:`MpidistError`, and
also from the built-in type a Python user would expect (``ValueError`` for bad
input, ``RuntimeError`` for a failure of the run), so both ``except`` styles
work. Errors coming out of MPI are translated into :class:`CommError` with
``raise ... from`` so the original MPI error stays attached.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

__all__ = [
    "MpidistError",
    "CheckpointError",
    "ChecksumError",
    "CommError",
    "CutOffError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "IntegerOverflowError",
    "MirrorDivergenceError",
    "NonFiniteError",
    "RankFailedError",
    "RankLeftError",
    "on_rank",
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


class RankLeftError(CollectiveTimeoutError):
    """A rank left the job (its script returned or called ``sys.exit``) while others still made collectives.

    Raised on the ranks that stay, at their next collective, within moments of
    the departure rather than at the deadline. ``missing_ranks`` lists the
    ranks that left (when they can be named: one or two at a time).
    """


class RankFailedError(CommError):
    """Ranks died (their process or node failed) while this rank made a collective.

    With ``fault_tolerance`` on, every surviving rank raises it from the
    collective in which it noticed, within the deadline, once the survivors
    agreed on who failed and rebuilt the communicator over themselves: the
    communicator (and the strategy) carry on with the survivors, renumbered
    in their old order. ``failed_ranks`` are the ranks that died, numbered as
    in the communicator before the failure (the same tuple on every
    survivor); ``size`` is the number of survivors. See
    ``docs/fault-tolerance.md`` for what a program does next.
    """

    def __init__(self, message: str, failed_ranks: Sequence[int] = (), size: int = 0) -> None:
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)
        self.size = size


class CutOffError(CommError):
    """Ranks died, and this rank is on the side that may not carry on (with ``fault_tolerance``).

    The survivors carry on only when they are more than half of the ranks
    there were, or exactly half with rank 0 among them: a link cut in two
    leaves both sides believing the other dead, and only one side may go on
    training and writing checkpoints. On the other side the collective that
    noticed raises this error (later ones a ``CommError`` saying that this
    side stopped, and ``strategy.recover()`` this error again); uncaught, the
    rank ends as a dead one would (killed,
    after writing its traceback) without aborting the job, so that the side
    that carries on is left alone.
    """


class NonFiniteError(MpidistError, FloatingPointError):
    """A reduction was refused because some ranks contributed NaN or Inf.

    Raised on every rank (with ``check_finite`` on) before any data moved.
    ``ranks`` lists the ranks whose contribution was not finite.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class IntegerOverflowError(MpidistError, OverflowError):
    """An integer SUM was refused because its result does not fit the dtype.

    Raised on every rank (with ``check_overflow`` on) before anything was
    written. ``name`` is the value reduced; ``indices`` the flat indices of
    the elements that overflow (at most the first ten).
    """

    def __init__(self, message: str, name: str = "", indices: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.indices = tuple(indices)


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


def format_ranks(ranks: Iterable[int], limit: int = 12) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``; ``[0, 2, 4, 6]`` -> ``"0-6:2"``: compact rank lists for messages.

    Runs of consecutive ranks become ranges, arithmetic progressions of four or
    more become strided ranges; after ``limit`` groups the rest is counted, so
    a list of thousands of ranks stays one short line.
    """
    rest = sorted(set(ranks))
    groups: list[str] = []
    i = 0
    while i < len(rest):
        if i + 1 == len(rest):
            groups.append(str(rest[i]))
            break
        j = i + 1
        step = rest[j] - rest[i]
        while j + 1 < len(rest) and rest[j + 1] - rest[j] == step:
            j += 1
        length = j - i + 1
        if step == 1:
            groups.append(f"{rest[i]}-{rest[j]}")
        elif length >= 4:
            groups.append(f"{rest[i]}-{rest[j]}:{step}")
        else:
            groups.append(str(rest[i]))
            j = i
        i = j + 1
    if len(groups) > limit:
        shown = groups[:limit]
        return ", ".join(shown) + f", ... ({len(rest)} ranks in all)"
    return ", ".join(groups)


def on_rank(rank: Optional[int], message: str) -> str:
    """The one prefix of mpidist's messages: ``"rank N: message"``, or ``"mpidist: message"`` without a rank.

    Every error and warning mpidist writes on a rank says which rank it comes
    from, first and in this one form, so that the interleaved output of a job
    can be read and grepped by rank. Messages about the whole job (written
    before MPI is up, or in the name of every rank) pass ``rank=None``.
    """
    return f"rank {rank}: {message}" if rank is not None else f"mpidist: {message}"
