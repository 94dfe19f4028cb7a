"""Serial tests of mpidist._values.nest (no MPI)."""

from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest

from mpidist._values.nest import (
    assert_same_structure,
    flatten,
    map_structure,
    map_structure_with_path,
    pack_sequence_as,
)

Point = namedtuple("Point", ["x", "y"])
Other = namedtuple("Other", ["x", "y"])

NESTS = [
    1,
    "a string is a leaf",
    None,
    [],
    (),
    {},
    [1, 2, 3],
    (1, [2, 3], {"b": 4, "a": 5}),
    Point(1, [2, Point(3, 4)]),
    {"z": [1, (2, 3)], "a": Point(4, 5), "m": {"q": 6}},
    [{"k": (1, 2)}, [[[]]], (None,)],
    {1: "one", 2: "two"},
]


@pytest.mark.parametrize("nest", NESTS)
def test_flatten_pack_round_trip(nest):
    flat = flatten(nest)
    rebuilt = pack_sequence_as(nest, flat)
    assert rebuilt == nest
    assert type(rebuilt) is type(nest)


def test_flatten_order_sorts_dict_keys():
    assert flatten({"b": 1, "a": 2, "c": [3, 4]}) == [2, 1, 3, 4]
    assert flatten(Point(x=[1, 2], y=3)) == [1, 2, 3]
    assert flatten(5) == [5]
    assert flatten([]) == []


def test_unsortable_keys_use_insertion_order():
    d = {"b": 1, 2: 2, (3,): 3}
    assert flatten(d) == [1, 2, 3]
    out = map_structure(lambda v: v * 10, d)
    assert out == {"b": 10, 2: 20, (3,): 30}
    assert list(out) == ["b", 2, (3,)]


def test_leaves_are_not_traversed():
    arr = np.arange(3)
    nest = [arr, {1, 2}, "abc", b"xy"]
    assert [a is b for a, b in zip(flatten(nest), nest)] == [True] * 4


def test_map_structure_keeps_types_and_key_order():
    nest = {"z": Point(1, 2), "a": [3, (4,)]}
    out = map_structure(lambda v: v + 1, nest)
    assert out == {"z": Point(2, 3), "a": [4, (5,)]}
    assert list(out) == ["z", "a"]  # the structure's own key order
    assert type(out["z"]) is Point


def test_map_structure_several_nests():
    a = [1, {"x": 2, "y": (3, 4)}]
    b = [10, {"y": (30, 40), "x": 20}]
    assert map_structure(lambda p, q: p + q, a, b) == [11, {"x": 22, "y": (33, 44)}]


def test_map_structure_dict_subclasses():
    od = OrderedDict([("b", 1), ("a", 2)])
    out = map_structure(lambda v: -v, od)
    assert type(out) is OrderedDict and list(out.items()) == [("b", -1), ("a", -2)]
    dd = defaultdict(list, {"a": 1})
    out = map_structure(lambda v: v * 2, dd)
    assert type(out) is defaultdict and out.default_factory is list and out == {"a": 2}


def test_map_structure_needs_a_nest():
    with pytest.raises(TypeError):
        map_structure(lambda: 0)


def test_map_structure_with_path():
    nest = [1, {"b": Point(2, 3)}]
    paths = []
    map_structure_with_path(lambda p, v: paths.append((p, v)), nest)
    assert paths == [("[0]", 1), ("[1]['b'].x", 2), ("[1]['b'].y", 3)]
    assert map_structure_with_path(lambda p, v: p, 7) == ""


@pytest.mark.parametrize(
    "a, b, fragment",
    [
        ([1, {"b": [1, 2]}], [1, {"b": [1, 2, 3]}], "at [1]['b']: list of 2 vs list of 3"),
        ([1, 2], (1, 2), "at top level: list of 2 vs tuple of 2"),
        (Point(1, 2), (1, 2), "Point (namedtuple) of 2 vs tuple of 2"),
        (Point(1, 2), Other(1, 2), "Point (namedtuple) of 2 vs Other (namedtuple) of 2"),
        ({"a": 1, "b": 2}, {"a": 1, "c": 2}, "only in the first: ['b']; only in the second: ['c']"),
        ([1, [2]], [1, 2], "at [1]: list of 1 vs leaf of type int"),
        (Point(1, [2]), Point(1, [2, 3]), "at .y: list of 1 vs list of 2"),
    ],
)
def test_structure_mismatch_names_path(a, b, fragment):
    with pytest.raises(ValueError, match="structure mismatch") as info:
        assert_same_structure(a, b)
    assert fragment in str(info.value)
    with pytest.raises(ValueError) as info2:
        map_structure(lambda *v: v, a, b)
    assert fragment in str(info2.value)


@pytest.mark.parametrize(
    "a, b",
    [
        (1, "x"),
        ([1, (2, 3)], ["a", ("b", [9])][:1] + [("b", None)]),
        ({"a": [1], "b": 2}, {"b": 3, "a": [4]}),
        (Point(1, 2), Point("p", "q")),
    ],
)
def test_same_structure_passes(a, b):
    assert_same_structure(a, b)


def test_pack_sequence_as_count_mismatch():
    with pytest.raises(ValueError, match="has 3 leaves but the flat sequence has 2"):
        pack_sequence_as([1, (2, 3)], [1, 2])


def test_pack_sequence_as_fills_in_flatten_order():
    structure = {"b": [0, 0], "a": Point(0, 0)}
    assert pack_sequence_as(structure, [1, 2, 3, 4]) == {"b": [3, 4], "a": Point(1, 2)}


@pytest.mark.parametrize("rebuild", ["pack_sequence_as", "map_structure", "map_structure_with_path"])
def test_rebuilding_leaves_no_reference_cycle(rebuild):
    """A batch packed by the input pipeline is freed as soon as the caller drops it, not at the next GC."""
    import gc
    import weakref

    held = [np.zeros(3)]  # the only strong reference to the leaf, outside what the rebuild returns
    alive = weakref.ref(held[0])
    structure = ({"a": 0}, [0])
    gc.disable()
    try:
        if rebuild == "pack_sequence_as":
            result = pack_sequence_as(structure, [held[0], held[0]])
        elif rebuild == "map_structure":
            result = map_structure(lambda x: held[0], structure)
        else:
            result = map_structure_with_path(lambda path, x: held[0], structure)
        assert result[0]["a"] is held[0] and result[1][0] is held[0]
        del result
        held.clear()
        assert alive() is None
    finally:
        gc.enable()
