"""Serial tests of the straggler report's arithmetic and of the words of a stalled collective.

The report runs on every rank over the sums of the agreement record; here the ranks are simulated
in one process: each stretch, every rank's :meth:`Straggler.stretch` gets the sums that the values all
ranks returned for the previous stretch add up to, as the record's allreduce would bring them.
"""

from __future__ import annotations

import logging

import pytest

from mpidist._comm.deadline import whereabouts_text
from mpidist._comm.straggler import FLOOR, STRETCH, Straggler, named_ranks
from mpidist._options import Options

WALL = 1.0  # seconds of wall time per stretch in the simulations (more than any rank's time outside waiting)


def simulate(times: list[list[float]], **options: object) -> tuple[list[Straggler], list[list[bool]]]:
    """Run the report over stretches of per-rank times outside waiting (seconds per stretch); the ranks' reports and,
    per stretch, which ranks wrote a late mark."""
    n = len(times[0])
    opts = Options.resolve(env={}, **options)
    ranks = [Straggler(r, n, opts, now=0.0) for r in range(n)]
    sums, waited, marks = [0.0] * 5, [0.0] * n, []
    for k, stretch in enumerate(times, start=1):
        outs = []
        for r, report in enumerate(ranks):
            waited[r] += WALL - stretch[r]  # a rank waits for the others whatever it did not spend outside
            a, mark = report.stretch(k * WALL, waited[r], *sums, k * STRETCH)
            outs.append((a, a * a, *mark))
        sums = [sum(column) for column in zip(*outs)]
        marks.append([out[2] == 1.0 for out in outs])
    return ranks, marks


def test_named_ranks_decodes_one_or_two_marked_ranks():
    assert named_ranks(1, 4.0, 16.0) == (3,)
    assert named_ranks(2, 1.0 + 5.0, 1.0 + 25.0) == (0, 4)
    assert named_ranks(3, 6.0, 14.0) == ()  # more than two are only counted


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_rank_30_percent_slower_is_named_by_rank_0(n, caplog):
    step = 0.05  # 50 ms per collective on the other ranks
    times = [[STRETCH * step * (1.3 if r == n - 1 else 1.0) for r in range(n)] for _ in range(20)]
    with caplog.at_level(logging.WARNING, logger="mpidist.comm"):
        reports, marks = simulate(times)
    first = next(k for k, row in enumerate(marks) if any(row))
    assert marks[first] == [r == n - 1 for r in range(n)]
    # each stretch is judged at the next one's start: marked as soon as half the window's stretches were slow
    assert first == reports[0].needed == 4
    lines = [r.getMessage() for r in caplog.records if r.name == "mpidist.comm"]
    assert len(lines) == 1, lines  # one line a minute at most, and the simulation lasts 20 s
    assert lines[0].startswith(f"mpidist: rank {n - 1} of {n} is slow: its time between collectives")
    assert "at least 20% above the mean of the other ranks in at least 4 of the last 8 stretches of 16" in lines[0]
    mean = step * (n - 1 + 1.3) / n
    assert f"spent {mean * 1e3:.2f} ms outside waiting on average" in lines[0], lines[0]
    assert reports[0].spread[0] == pytest.approx(mean)


def test_no_rank_is_named_when_the_ranks_are_alike_or_one_paused_once(caplog):
    alike = [[0.8, 0.8, 0.8]] * 30
    paused = [list(stretch) for stretch in alike]
    paused[10][1] = 0.99  # one long pause on rank 1: one stretch, never a straggler
    with caplog.at_level(logging.WARNING, logger="mpidist.comm"):
        for times in (alike, paused):
            _, marks = simulate(times)
            assert not any(any(row) for row in marks)
    assert not caplog.records


def test_a_rank_only_a_little_slower_in_time_is_not_named():
    """Ten times slower, but with steps of microseconds: a gap under FLOOR per collective is never a straggler."""
    tiny = STRETCH * 20e-6
    _, marks = simulate([[tiny, tiny * 10] for _ in range(30)])
    assert not any(any(row) for row in marks)
    _, marks = simulate([[tiny, tiny + STRETCH * FLOOR * 1.1] for _ in range(30)])
    assert any(row[1] for row in marks)


def test_two_slow_ranks_are_named_together_and_the_options_apply(caplog):
    times = [[0.2, 0.3, 0.2, 0.3] for _ in range(12)]
    with caplog.at_level(logging.WARNING, logger="mpidist.comm"):
        _, marks = simulate(times)  # 1.29x the mean of the other three: slow at 20%, not at 50%
        assert not any(any(row) for row in simulate(times, straggler_threshold=0.5)[1])
        simulate(times, straggler_interval=None)  # no lines at all
    assert marks[-1] == [False, True, False, True]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("mpidist: ranks 1, 3 of 4 are slow: their time between"), lines
    reports, marks = simulate(times, straggler_window=48)  # three stretches: marked once two were slow
    assert reports[0].needed == 2 and next(k for k, row in enumerate(marks) if any(row)) == 2


def test_a_stall_says_where_each_rank_waits_and_where_the_silent_ones_were_last_seen():
    places = dict.fromkeys((0, 1, 2), (42, "train.py:88", "allreduce(sum) of 'grads' float32[10]"))
    places[4] = (42, "train.py:90", "allreduce(sum) of 'grads' float32[10]")
    text = whereabouts_text(places, [3, 5], (41, "train.py:95", "broadcast(root=0) of 'w' float64[2]"))
    assert text == (
        "ranks 0-2 wait at train.py:88 (#42 allreduce(sum) of 'grads' float32[10]); "
        "rank 4 waits at train.py:90 (#42 allreduce(sum) of 'grads' float32[10]); "
        "ranks 3, 5 have not answered (outside mpidist, or unreachable), last seen in #41 broadcast(root=0) of 'w' "
        "float64[2], a call this rank first made at train.py:95"
    )
    assert whereabouts_text({0: (7, "", "exit of this rank")}, [1], (6, "", "")) == (
        "rank 0 waits in #7 exit of this rank; rank 1 has not answered (outside mpidist, or unreachable), "
        "last seen in #6"
    )
    everyone = whereabouts_text({0: (5, "a.py:1", "barrier of 'barrier'"), 1: (6, "a.py:3", "x")}, [], (4, "", ""))
    assert everyone.startswith("every rank answered, so all are inside collectives of this communicator but not")
    assert everyone.endswith("rank 0 waits at a.py:1 (#5 barrier of 'barrier'); rank 1 waits at a.py:3 (#6 x)")
    many = whereabouts_text({r: (9, f"f.py:{r}", "x") for r in range(500)}, [500], (8, "", ""))
    assert "; ... (500 places in all); rank 500 has not answered" in many and len(many) < 2200
