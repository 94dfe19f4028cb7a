"""``Communicator.outcome`` ("did every rank succeed?") and ``describe_failures``, under mpiexec (1, 2, 3 ranks).

Expected values are derived from rank and size. Each check runs over a
duplicate of COMM_SELF and of COMM_WORLD, with the agreement's checks on and
off (and with and without a deadline), twice in a row, and is followed by a
collective that must still line up on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._comm.communicator import Communicator, describe_failures
from mpidist._options import Options

pytestmark = pytest.mark.mpi

MODES = {
    "checked": dict(),
    "unchecked": dict(check_collectives=False, timeout=None),
    "deadline-only": dict(check_collectives=False, timeout=60.0),
}


@pytest.fixture(
    scope="module",
    params=[(base, mode) for base in ("self", "world") for mode in MODES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def comm(request):
    base, mode = request.param
    c = Communicator(MPI.COMM_SELF if base == "self" else MPI.COMM_WORLD, Options.resolve(env={}, **MODES[mode]))
    yield c
    c.free()


def still_in_step(c: Communicator) -> None:
    """A collective after the outcome: every rank must reach it with the same numbering."""
    total = c.allreduce(np.array([c.rank + 1.0]), name="after outcome")
    assert total[0] == c.size * (c.size + 1) / 2


@pytest.mark.parametrize("repeat", [0, 1])
def test_nobody_fails(comm, repeat):
    assert comm.outcome(None, "step") == {}
    still_in_step(comm)


@pytest.mark.parametrize("failing", ["odd", "last", "all"])
def test_failed_ranks_on_every_rank(comm, failing):
    fails = {"odd": lambda r: r % 2 == 1, "last": lambda r: r == comm.size - 1, "all": lambda r: True}[failing]
    expected = [r for r in range(comm.size) if fails(r)]
    mine = OSError(f"disk {comm.rank} full") if fails(comm.rank) else None
    for _ in range(2):
        failures = comm.outcome(mine, "save")
        assert sorted(failures) == expected
        for r in expected:
            if r == comm.rank:
                assert failures[r] is mine
            else:
                assert failures[r] == f"OSError: disk {r} full"
        still_in_step(comm)


def test_failures_described_alike_on_every_rank(comm):
    """The same line on every rank: ranks grouped by message, exceptions written like the strings."""
    error = ValueError("bad shape") if comm.rank % 2 == 0 else KeyError("w")
    line = describe_failures(comm.outcome(error, "restore"))
    lines = comm.allgather_bytes(line.encode(), name="lines")
    assert len(set(lines)) == 1
    evens, odds = list(range(0, comm.size, 2)), list(range(1, comm.size, 2))
    expected = {tuple(evens): "ValueError: bad shape", tuple(odds): "KeyError: 'w'"}
    parts = line.split("; ")
    assert len(parts) == len([k for k in expected if k])
    for ranks, text in expected.items():
        if ranks:
            assert any(p.endswith(": " + text) for p in parts), (line, text)
    still_in_step(comm)


def test_describe_failures_groups_ranks():
    assert describe_failures({}) == ""
    assert describe_failures({0: "X: a", 1: "X: a", 3: "Y: b"}) == "ranks 0-1: X: a; rank 3: Y: b"
    assert (
        describe_failures({2: ValueError("v"), 0: "ValueError: v", 1: "E: e"})
        == "ranks 0, 2: ValueError: v; rank 1: E: e"
    )
    many = {r: f"E: failure {r}" for r in range(500)}
    assert describe_failures(many).endswith("(500 different failures in all)")


def test_one_rank_costs_nothing():
    """At one rank the answer needs no MPI: it works even on a communicator already freed."""
    c = Communicator(MPI.COMM_SELF, Options.resolve(env={}))
    c.free()
    error = RuntimeError("alone")
    assert c.outcome(None, "x") == {}
    assert c.outcome(error, "x") == {0: error}
