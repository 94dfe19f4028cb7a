"""The straggler report: which rank keeps the others waiting, from five sums in the agreement record.

Every rank measures, stretch by stretch of :data:`STRETCH` collectives, how long it
spent *outside waiting*: the stretch's wall time less the time it waited in MPI
for the other ranks (:attr:`~mpidist._comm.deadline.Deadline.waited`, counted
in waits that outlast the busy polling, so that no collective pays for it and
a rank that arrives last counts nothing). That is its own computation between
collectives plus mpidist's own work, which is alike on every rank (and waits
of tens of microseconds, far below :data:`FLOOR`). At the
first collective of each stretch every rank writes into the agreement record
its time ``a`` of the stretch just ended and ``a**2``, and a *late mark* naming
itself (1, ``rank+1``, ``(rank+1)**2``, the rank-naming trick of the leaving
mark) when it judged itself persistently slow. The record's sums reach every
rank, so every rank knows the mean and the spread of the ranks' times, and
judges itself against the mean of the others, ``(sum - a) / (N - 1)``; rank 0
decodes the late marks and logs a line naming the slow ranks (logger
``mpidist.comm``, WARNING), at most once per ``options.straggler_interval``.

A stretch is *slow* for a rank when its time was at least
``1 + options.straggler_threshold`` times the others' mean *and* above it by at
least :data:`FLOOR` per collective (smaller gaps cost little, and are how a
busy machine shares its cores: with steps of microseconds, a rank that waits
its turn for a core looks many times slower). A rank marks itself late when at
least half the stretches of the last ``options.straggler_window`` collectives
were slow for it (its median stretch was slow): persistent, so that one long
pause (a rank descheduled, a garbage collection) is one stretch and never names
a rank. Everything here is local arithmetic, once per stretch: the slots ride in
the agreement's one allreduce; between stretches every rank leaves them as they
are, so every record sums the same values.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from mpidist._errors import format_ranks, on_rank
from mpidist._options import Options
from mpidist._units import human_time

__all__ = ["FLOOR", "STRETCH", "Straggler", "named_ranks"]

logger = logging.getLogger("mpidist.comm")

STRETCH = 16  # collectives per stretch: the report's record slots are written and read at every STRETCH-th collective
FLOOR = 1e-3  # seconds per collective: a rank whose excess over the others' mean is smaller is never named
_FLOOR_STRETCH = FLOOR * STRETCH
_CALM = (0.0, 0.0, 0.0)  # the late mark of a rank that is not late


def named_ranks(count: int, s1: float, s2: float) -> tuple[int, ...]:
    """Local: the ranks marked, from their count and the sums of (rank+1) and (rank+1)**2 (exact for 1 or 2).

    The rank-naming trick of the agreement record: more than two marked ranks are only counted (empty tuple).
    """
    if count == 1:
        return (int(s1) - 1,)
    if count == 2:
        # a + b = s1, a**2 + b**2 = s2  ->  a, b = (s1 -+ sqrt(2*s2 - s1**2)) / 2
        d = math.isqrt(max(0, int(2 * s2 - s1 * s1)))
        return (int(s1 - d) // 2 - 1, int(s1 + d) // 2 - 1)
    return ()


class Straggler:
    """One rank's side of the straggler report over one communicator. Local object.

    :meth:`stretch` runs at the first collective of every stretch, before the
    record is sent: it judges the stretch whose sums the last record brought,
    and returns what this rank writes for the stretch that ends now.
    """

    def __init__(self, rank: int, size: int, options: Options, now: float) -> None:
        self.rank, self.size = rank, size
        self.threshold = float(options.straggler_threshold)
        self.stretches = -(-options.straggler_window // STRETCH)  # the window in whole stretches
        self.needed = -(-self.stretches // 2)  # slow stretches in the window that mark a rank late: half of them
        self.interval = options.straggler_interval
        self._history = 0  # bit k: whether the stretch judged k stretches ago was slow for this rank
        self._window = (1 << self.stretches) - 1
        self._started, self._waited = now, 0.0  # when the stretch began, and Deadline.waited then
        self._mine = 0.0  # this rank's time in the stretch it reported last (what it judges next)
        self._calm, self._late = _CALM, (1.0, rank + 1.0, (rank + 1.0) ** 2)  # the late marks it writes
        self._logged: Optional[float] = None  # when rank 0 last logged a line
        self._sums = (0.0, 0.0)  # the sums of the ranks' times and of their squares, in the stretch judged last

    @property
    def late(self) -> bool:
        """Whether this rank is persistently slow: slow in at least half the stretches of the window."""
        return bin(self._history).count("1") >= self.needed

    @property
    def spread(self) -> tuple[float, float]:
        """The mean and the standard deviation over the ranks of the time outside waiting per collective, in the
        stretch judged last (the same on every rank: every rank knows the spread)."""
        total, squares = self._sums
        mean = total / self.size
        return mean / STRETCH, math.sqrt(max(squares / self.size - mean * mean, 0.0)) / STRETCH

    def stretch(
        self, now: float, waited: float, total: float, squares: float, marked: float, s1: float, s2: float, seq: int
    ) -> tuple[float, tuple[float, float, float]]:
        """Local, at collective ``seq``, the first of a stretch: judge the stretch that the record's sums describe
        (``total`` and ``squares`` of the ranks' times, and their late marks: ``marked`` ranks, the sums of
        ``rank+1`` and ``(rank+1)**2``); return what this rank writes for the stretch ending now: its time, and
        its late mark (one of two tuples, the same objects every time).

        ``now`` is the clock, ``waited`` the transport's :attr:`~mpidist._comm.deadline.Deadline.waited`.
        (Once per stretch of collectives: kept short.)
        """
        if total > 0 and self.size > 1:  # no sums before the first stretch's end
            mine = self._mine
            others = (total - mine) / (self.size - 1)
            excess = mine - others
            history = self._history << 1
            if excess >= self.threshold * others and excess >= _FLOOR_STRETCH:
                history |= 1
            self._history = history & self._window
            self._sums = (total, squares)
            if marked and self.rank == 0 and self.interval is not None:
                self._log(round(marked), s1, s2, now, seq)
        a = now - self._started - waited + self._waited
        self._started, self._waited, self._mine = now, waited, a
        return a, self._late if self.late else self._calm

    def _log(self, count: int, s1: float, s2: float, now: float, seq: int) -> None:
        """Rank 0: the line naming the ranks marked late, unless one was logged less than an interval ago."""
        assert self.interval is not None
        if self._logged is not None and now - self._logged < self.interval:
            return
        self._logged = now
        logger.warning("%s", on_rank(None, self.describe(named_ranks(count, s1, s2), count, seq)))

    def describe(self, ranks: tuple[int, ...], count: int, seq: int) -> str:
        """Local: the straggler line for the marked ``ranks`` (``count`` of them, named when one or two)."""
        many = count > 1
        who = f"rank{'s' if many else ''} {format_ranks(ranks)}" if ranks else f"{count} ranks"
        mean, sd = self.spread
        return (
            f"{who} of {self.size} {'are' if many else 'is'} slow: {'their' if many else 'its'} time between "
            f"collectives (outside waiting for the other ranks) was at least {self.threshold:.0%} above the mean "
            f"of the other ranks in at least {self.needed} of the last {self.stretches} stretches of {STRETCH} "
            f"collectives (up to #{seq}), so the others wait for {'them' if many else 'it'} at every collective; per "
            f"collective the ranks spent {human_time(mean)} outside waiting on average, spread {human_time(sd)} "
            "(standard deviation)"
        )
