"""The rule that picks the reduction algorithm (flat or two-level), serially: the option, the nodes, the size.

:func:`two_level_from` is the rule; :class:`Algorithms` is checked with stand-ins for the transport,
the topology and the two-level algorithm (which would split communicators), so that every case of
the rule runs here, also those that need several nodes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpidist import Options
from mpidist._comm import algorithms
from mpidist._comm.algorithms import TWO_LEVEL_FROM, Algorithms, Flat, two_level_from

PIECE = Options().piece_bytes


@pytest.mark.parametrize("open_mpi", [True, False])
@pytest.mark.parametrize("num_nodes, size", [(1, 1), (1, 4), (2, 2), (2, 4), (3, 5)])
def test_forced_either_way_whatever_the_nodes_and_library(open_mpi, num_nodes, size):
    assert two_level_from(True, num_nodes, size, PIECE, open_mpi) == 0
    assert two_level_from(False, num_nodes, size, PIECE, open_mpi) is None


@pytest.mark.parametrize(
    "num_nodes, size, open_mpi, expected",
    [
        (1, 1, True, None),  # one rank
        (1, 8, True, None),  # one node: today's flat reduction, the two-level one never built
        (4, 4, True, None),  # one rank per node: nothing to reduce within a node
        (2, 4, True, TWO_LEVEL_FROM),  # 2 nodes x 2 ranks
        (2, 3, True, TWO_LEVEL_FROM),  # nodes of unequal sizes: one of them holds two ranks
        (16, 64, True, TWO_LEVEL_FROM),
        (2, 4, False, None),  # MPICH: its own flat allreduce was at the link bound
        (1, 8, False, None),
    ],
)
def test_auto(num_nodes, size, open_mpi, expected):
    assert two_level_from(None, num_nodes, size, PIECE, open_mpi) == expected


def test_auto_takes_every_whole_piece_when_pieces_are_smaller_than_the_threshold():
    assert TWO_LEVEL_FROM <= PIECE  # by default every piece of a large reduction takes the two-level algorithm
    small = TWO_LEVEL_FROM // 4
    assert two_level_from(None, 2, 4, small, True) == small
    assert two_level_from(None, 2, 4, 4 * TWO_LEVEL_FROM, True) == TWO_LEVEL_FROM


class _TwoLevel:
    """Stands in for :class:`~mpidist._comm.algorithms.Hierarchical` (whose construction is collective)."""

    built = 0

    def __init__(self, transport, topology, device_buffers=False):
        _TwoLevel.built += 1
        self.freed = False

    def free(self):
        self.freed = True


@pytest.fixture
def build(monkeypatch):
    """``build(num_nodes, size, library, **options)``: an :class:`Algorithms` over stand-ins."""
    monkeypatch.setattr(algorithms, "Hierarchical", _TwoLevel)
    _TwoLevel.built = 0

    def make(num_nodes, size, library="Open MPI v5.0.11", **options):
        monkeypatch.setattr(algorithms, "library_version", lambda: library)
        transport = SimpleNamespace(options=Options(**options), size=size)
        return Algorithms(transport, SimpleNamespace(num_nodes=num_nodes))

    return make


def test_one_node_builds_no_two_level_algorithm_and_always_chooses_flat(build):
    for options in ({}, {"hierarchical": False}, {"node_size": 2}):
        a = build(1, 4, **options)
        assert a.hierarchical is None and isinstance(a.flat, Flat)
        assert all(a.choose(n) is a.flat for n in (0, 8, TWO_LEVEL_FROM, 1 << 30))
    assert _TwoLevel.built == 0


def test_across_nodes_auto_chooses_by_size(build):
    a = build(2, 4)
    assert isinstance(a.hierarchical, _TwoLevel) and _TwoLevel.built == 1
    assert a.choose(8) is a.flat and a.choose(TWO_LEVEL_FROM - 1) is a.flat
    assert a.choose(TWO_LEVEL_FROM) is a.hierarchical and a.choose(1 << 30) is a.hierarchical
    a.free()
    assert a.hierarchical.freed


def test_across_nodes_forced_and_other_libraries(build):
    forced = build(2, 4, hierarchical=True)
    assert forced.choose(0) is forced.hierarchical and forced.choose(8) is forced.hierarchical
    assert build(2, 4, hierarchical=False).hierarchical is None
    assert build(4, 4).hierarchical is None  # one rank per node
    mpich = build(2, 4, library="MPICH Version: 5.0.2")
    assert mpich.hierarchical is None and mpich.choose(1 << 30) is mpich.flat
    one = build(1, 4, hierarchical=True)  # forced on one node: built, as before
    assert one.choose(8) is one.hierarchical
    assert _TwoLevel.built == 2


def test_compressed_reductions_take_the_two_level_algorithm_across_nodes_under_any_library(build):
    for library in ("MPICH Version: 5.0.2", "Open MPI v5.0.11"):
        a = build(2, 4, library=library, compression="bf16")
        assert isinstance(a.hierarchical, _TwoLevel) and a.choose_compressed() is a.hierarchical
        if library.startswith("MPICH"):  # exact reductions keep their own rule: flat under MPICH
            assert a.choose(1 << 30) is a.flat
        assert a.choose(8) is a.flat  # and below the threshold under Open MPI
    for flat in (build(2, 4, compression="fp16", hierarchical=False), build(4, 4, compression="fp16"), build(1, 4)):
        assert flat.hierarchical is None and flat.choose_compressed() is flat.flat
    forced = build(1, 4, hierarchical=True)
    assert forced.choose_compressed() is forced.hierarchical
    assert _TwoLevel.built == 3


def test_the_option_three_ways_and_its_environment_variable():
    assert Options().hierarchical is None
    assert Options.resolve(env={}).hierarchical is None
    for text, value in (("auto", None), ("AUTO", None), ("1", True), ("true", True), ("off", False), ("0", False)):
        assert Options.resolve(env={"MPIDIST_HIERARCHICAL": text}).hierarchical is value
    assert Options.resolve(env={"MPIDIST_HIERARCHICAL": "1"}, hierarchical=None).hierarchical is None
    with pytest.raises(ValueError, match="MPIDIST_HIERARCHICAL: expected auto or one of 1/0"):
        Options.resolve(env={"MPIDIST_HIERARCHICAL": "sometimes"})
    with pytest.raises(TypeError, match=r"option hierarchical must be True, False or None \(auto\), got 'auto'"):
        Options(hierarchical="auto")  # type: ignore[arg-type]
