"""Serial tests of mpidist._values.values (no MPI): distributed values, regroup, select_replica."""

import copy
import gc
import operator
import pickle
import re
from collections import namedtuple
from typing import ClassVar

import numpy as np
import pytest

from mpidist._values import values as _values
from mpidist._values.nest import flatten, map_structure
from mpidist._values.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    _owner_of,
    register_component,
    regroup,
    select_replica,
    select_replica_mirrored,
)

Pair = namedtuple("Pair", ["first", "second"])


class _Var(DistributedValues):
    """Minimal stand-in for a distributed variable: registers its components."""

    def __init__(self, index):
        super().__init__(index)
        for rid, component in self._index.items():
            register_component(self, rid, component)


class _MirroredSub(Mirrored):
    pass


# --------------------------------------------------------------------------
# DistributedValues
# --------------------------------------------------------------------------


def test_values_and_ids_are_ordered_by_replica_id():
    dv = PerReplica({2: "c", 0: "a", 1: "b"})
    assert dv.replica_ids == (0, 1, 2)
    assert dv.values == ("a", "b", "c")
    assert dv.get(1) == "b"


def test_numpy_integer_ids_are_normalized():
    dv = PerReplica({np.int64(3): "x"})
    assert dv.replica_ids == (3,)
    assert type(dv.replica_ids[0]) is int
    assert dv.get(np.int32(3)) == "x"


def test_get_none_returns_single_local_component():
    arr = np.arange(3)
    assert PerReplica({4: arr}).get() is arr
    assert Mirrored({4: arr}).get(None) is arr


def test_get_none_with_several_components_asks_for_replica_id():
    with pytest.raises(ValueError, match=r"replicas \[0, 1\].*pass replica_id"):
        PerReplica({0: 1.0, 1: 2.0}).get()


def test_get_non_local_id_names_requested_and_local_ids():
    with pytest.raises(ValueError) as info:
        PerReplica({0: 1.0, 2: 2.0}).get(5)
    msg = str(info.value)
    assert "replica 5 is not local" in msg and "[0, 2]" in msg


@pytest.mark.parametrize("bad_id", ["0", 1.0, True])
def test_get_rejects_non_int_ids(bad_id):
    with pytest.raises(TypeError, match="must be an int"):
        PerReplica({0: 1, 1: 2}).get(bad_id)


@pytest.mark.parametrize(
    "index, exc, fragment",
    [
        ({}, ValueError, "empty index"),
        ({"0": 1}, TypeError, "must be an int"),
        ({1.5: 1}, TypeError, "must be an int"),
        ({True: 1}, TypeError, "must be an int"),
        ({-1: 1}, ValueError, ">= 0"),
        ([1, 2], TypeError, "mapping"),
    ],
)
@pytest.mark.parametrize("cls", [DistributedValues, PerReplica, Mirrored])
def test_constructor_rejects_bad_index(cls, index, exc, fragment):
    with pytest.raises(exc, match=fragment):
        cls(index)


@pytest.mark.parametrize("cls", [PerReplica, Mirrored, DistributedValues])
def test_repr_and_str(cls):
    dv = cls({0: np.array([1.0, 2.0])})
    expected = f"{cls.__name__}({{0: array([1., 2.])}})"
    assert repr(dv) == expected
    assert str(dv) == expected


def test_index_is_copied():
    index = {0: 1}
    dv = PerReplica(index)
    index[0] = 2
    assert dv.get() == 1


def test_per_replica_is_not_a_delegate():
    pr = PerReplica({0: np.arange(3)})
    with pytest.raises(TypeError):
        pr + 1
    with pytest.raises(TypeError):
        pr[0]
    assert not hasattr(pr, "shape")
    assert {pr: 1}[pr] == 1  # hashable by identity


# --------------------------------------------------------------------------
# Mirrored: delegation
# --------------------------------------------------------------------------

FLOAT_A = np.array([1.5, -2.0, 3.25])
FLOAT_B = np.array([0.5, 4.0, -1.5])
INT_A = np.array([6, 3, 12])
INT_B = np.array([4, 5, 3])

ARITH = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, divmod]
FLOAT_ONLY = [operator.pow]
COMPARE = [operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne]
BITWISE = [operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift]


def _assert_plain_equal(got, want):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_plain_equal(g, w)
        return
    assert not isinstance(got, DistributedValues)
    assert type(got) is type(want)
    np.testing.assert_array_equal(got, want)


def _operand_cases(side):
    positive = np.abs(FLOAT_B) + 0.5
    for op in ARITH + COMPARE:
        yield op, FLOAT_A, FLOAT_B
        yield op, FLOAT_A, 2.0
    for op in FLOAT_ONLY:
        yield op, np.abs(FLOAT_A), positive if side == "right" else FLOAT_B
        yield op, np.abs(FLOAT_A), 2
    for op in BITWISE:
        yield op, INT_A, INT_B
        yield op, INT_A, 1
    matrix = np.arange(6.0).reshape(2, 3)
    if side == "left":
        yield operator.matmul, matrix, np.arange(12.0).reshape(3, 4)
    else:
        yield operator.matmul, matrix, np.arange(8.0).reshape(4, 2)
    yield operator.matmul, FLOAT_A, FLOAT_B


def _case_id(x):
    if isinstance(x, np.ndarray):
        return "x".join(map(str, x.shape)) + str(x.dtype)
    return getattr(x, "__name__", None) or repr(x)


@pytest.mark.parametrize("op, component, other", list(_operand_cases("left")), ids=_case_id)
def test_mirrored_operators_left(op, component, other):
    _assert_plain_equal(op(Mirrored({0: component}), other), op(component, other))


@pytest.mark.parametrize("op, component, other", list(_operand_cases("right")), ids=_case_id)
def test_mirrored_reflected_operators(op, component, other):
    _assert_plain_equal(op(other, Mirrored({0: component})), op(other, component))


class _Guarded(PerReplica, _values.ComponentOperators):
    """Operators without delegation, on a component its conversion may refuse (as a sync-on-read variable)."""

    refuse = False

    def _convertible(self):
        if self.refuse:
            raise TypeError("refused")
        return super()._convertible()


@pytest.mark.parametrize("op, component, other", list(_operand_cases("left")), ids=_case_id)
def test_component_operators_use_the_converted_component(op, component, other):
    value = _Guarded({0: component})
    _assert_plain_equal(op(value, other), op(component, other))
    _assert_plain_equal(np.float64(2) - _Guarded({0: np.arange(3.0)}), 2 - np.arange(3.0))  # reflected
    assert not hasattr(value, "shape")  # operators only: attributes are not delegated
    value.refuse = True
    with pytest.raises(TypeError, match="refused"):
        op(value, other)


@pytest.mark.parametrize(
    "op, component",
    [
        (operator.neg, FLOAT_A),
        (operator.pos, FLOAT_A),
        (operator.invert, INT_A),
        (abs, FLOAT_A),
        (operator.neg, 3),
        (abs, -2.5),
        (operator.invert, 5),
    ],
)
def test_mirrored_unary_operators(op, component):
    _assert_plain_equal(op(Mirrored({0: component})), op(component))


def test_mirrored_three_argument_pow():
    assert pow(Mirrored({0: 5}), 3, 7) == pow(5, 3, 7)
    assert pow(Mirrored({0: np.array([2, 3])}), 2).tolist() == [4, 9]


def test_mirrored_operators_between_two_mirrored():
    a, b = Mirrored({0: FLOAT_A}), Mirrored({0: FLOAT_B})
    _assert_plain_equal(a + b, FLOAT_A + FLOAT_B)
    _assert_plain_equal(a @ b, FLOAT_A @ FLOAT_B)
    _assert_plain_equal(a < b, FLOAT_A < FLOAT_B)


def test_mirrored_with_python_scalars():
    m = Mirrored({0: 7})
    assert m + 1 == 8 and 1 + m == 8 and 10 - m == 3 and m // 2 == 3 and 2**m == 128
    assert m > 3 and m > 3 and m == 7 and m != 8
    assert (m & 3, 3 | m, m ^ 1) == (3, 7, 6)


def test_mirrored_numpy_ufuncs_and_mixed_operands():
    m = Mirrored({0: FLOAT_A})
    M = np.arange(9.0).reshape(3, 3)
    for got, want in [
        (np.ones(3) + m, np.ones(3) + FLOAT_A),
        (m + np.ones(3), FLOAT_A + np.ones(3)),
        (m @ M, FLOAT_A @ M),
        (M @ m, M @ FLOAT_A),
        (-m, -FLOAT_A),
        (m[1:], FLOAT_A[1:]),
        (np.sin(m), np.sin(FLOAT_A)),
        (np.add(m, 1.0), FLOAT_A + 1.0),
        (np.ones(3) < m, np.ones(3) < FLOAT_A),
    ]:
        assert type(got) is np.ndarray
        np.testing.assert_array_equal(got, want)
    # NumPy defers to Mirrored's reflected operators (higher __array_priority__).
    assert np.ones(3).__add__(m) is NotImplemented
    assert m.shape == (3,)
    assert m.dtype == np.float64
    assert m.sum() == FLOAT_A.sum()
    np.testing.assert_array_equal(m.T, FLOAT_A.T)


def test_mirrored_in_place_operator_rebinds_without_touching_component():
    component = np.array([1.0, 2.0])
    m = Mirrored({0: component})
    name = m
    name += 1
    assert type(name) is np.ndarray
    np.testing.assert_array_equal(component, [1.0, 2.0])


def test_mirrored_container_protocol():
    m = Mirrored({0: [10, 20, 30]})
    assert len(m) == 3
    assert list(m) == [10, 20, 30]
    assert m[1] == 20 and m[-1] == 30
    assert 20 in m and 5 not in m


@pytest.mark.parametrize(
    "conv, component",
    [
        (float, 2.5),
        (int, 2.9),
        (complex, 1.5),
        (bool, 0),
        (bool, 3),
        (operator.index, 4),
        (round, 2.567),
        (float, np.float32(1.25)),
    ],
)
def test_mirrored_conversions(conv, component):
    got = conv(Mirrored({0: component}))
    assert got == conv(component) and type(got) is type(conv(component))


def test_mirrored_index_round_and_format():
    assert list(range(Mirrored({0: 3}))) == [0, 1, 2]
    assert [10, 11, 12][Mirrored({0: np.int64(1)})] == 11
    assert round(Mirrored({0: 2.567}), 2) == 2.57
    m = Mirrored({0: 3.14159})
    assert f"{m:.2f}" == "3.14"
    assert f"{m}" == str(m) == "Mirrored({0: 3.14159})"


def test_mirrored_bool_of_array_raises_like_numpy():
    with pytest.raises(ValueError):
        bool(Mirrored({0: np.array([1, 2])}))


def test_mirrored_hash_is_identity():
    a, b = Mirrored({0: np.arange(2)}), Mirrored({0: np.arange(2)})
    assert hash(a) == object.__hash__(a)
    assert len({a, b, a}) == 2
    np.testing.assert_array_equal(a == b, [True, True])


def test_numpy_asarray_of_mirrored_is_the_local_data():
    component = np.arange(4.0)
    m = Mirrored({0: component})
    view = np.asarray(m)
    assert type(view) is np.ndarray and np.shares_memory(view, component)
    np.testing.assert_array_equal(view, component)
    as_int = np.asarray(m, dtype=np.int32)
    assert as_int.dtype == np.int32 and as_int.tolist() == [0, 1, 2, 3]
    copied = np.array(m, copy=True)
    assert not np.shares_memory(copied, component)
    np.testing.assert_array_equal(copied, component)
    if int(np.__version__.split(".")[0]) >= 2:
        assert np.shares_memory(np.asarray(m, copy=False), component)
    np.testing.assert_array_equal(np.asarray(Mirrored({0: [1, 2]})), [1, 2])


class _DeviceArrayLike:
    """Mimics a CuPy array: no implicit host conversion, a CUDA array interface."""

    __cuda_array_interface__: ClassVar[dict] = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed.")


def test_numpy_asarray_fails_like_the_device_component():
    m = Mirrored({0: _DeviceArrayLike()})
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(m)
    assert m.__cuda_array_interface__ is _DeviceArrayLike.__cuda_array_interface__
    assert not hasattr(m, "__dlpack__")


def test_array_protocols_are_truthful():
    m = Mirrored({0: np.arange(3.0)})
    assert not hasattr(m, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="__cuda_array_interface__"):
        m.__cuda_array_interface__
    assert hasattr(m, "__dlpack__") and hasattr(m, "__dlpack_device__")
    assert m.__dlpack_device__() == np.arange(3.0).__dlpack_device__()
    np.testing.assert_array_equal(np.from_dlpack(m), np.arange(3.0))
    plain = Mirrored({0: [1, 2]})
    assert not hasattr(plain, "__dlpack__") and not hasattr(plain, "__dlpack_device__")


def test_private_names_are_not_delegated():
    m = Mirrored({0: np.arange(3)})
    with pytest.raises(AttributeError):
        m._something
    with pytest.raises(AttributeError):
        m.__deepcopy_helper__
    with pytest.raises(AttributeError, match="no_such_attr"):
        m.no_such_attr


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_mirrored_copy_and_pickle(clone):
    m = Mirrored({1: np.arange(3.0)})
    c = clone(m)
    assert type(c) is Mirrored
    assert c.replica_ids == (1,)
    np.testing.assert_array_equal(c.get(), np.arange(3.0))


def test_uninitialized_mirrored_does_not_recurse():
    m = Mirrored.__new__(Mirrored)
    assert not hasattr(m, "shape")
    assert not hasattr(m, "_index")
    assert "uninitialized" in repr(m)


def test_mirrored_with_several_components_requires_an_id():
    m = Mirrored({0: 1.0, 1: 1.0})
    assert m.get(1) == 1.0
    with pytest.raises(ValueError, match="pass replica_id"):
        m + 1


# --------------------------------------------------------------------------
# Component registry
# --------------------------------------------------------------------------


def test_owner_of_registered_components():
    comps = {0: np.zeros(2), 1: np.ones(2)}
    var = _Var(comps)
    for rid in (0, 1):
        owner, owner_rid = _owner_of(comps[rid])
        assert owner is var and owner_rid == rid
    assert _owner_of(np.zeros(2)) is None
    assert _owner_of(var) is None


def test_registry_entry_dropped_when_container_dies():
    component = np.zeros(3)
    var = _Var({0: component})
    assert id(component) in _values._registry
    del var
    gc.collect()
    assert id(component) not in _values._registry
    assert _owner_of(component) is None


def test_owner_verifies_container_still_holds_the_object():
    old = np.zeros(3)
    var = _Var({0: old})
    var._index[0] = np.ones(3)  # component replaced: old is no longer the variable's
    assert _owner_of(old) is None
    assert regroup({0: old}) is old


def test_reregistered_component_survives_death_of_first_container():
    component = np.zeros(2)
    first = _Var({0: component})
    second = _Var({0: component})
    del first
    gc.collect()
    owner, _ = _owner_of(component)
    assert owner is second


@pytest.mark.parametrize("component", [1, 2.0, "s", None, True, (1, 2)])
def test_register_component_rejects_immutable_builtins(component):
    with pytest.raises(TypeError, match="owned by its container"):
        register_component(PerReplica({0: component}), 0, component)


def test_register_component_rejects_non_container():
    with pytest.raises(TypeError, match="DistributedValues"):
        register_component(object(), 0, np.zeros(1))
    with pytest.raises(TypeError):
        register_component(PerReplica({0: 1}), "0", np.zeros(1))


# --------------------------------------------------------------------------
# regroup / select_replica
# --------------------------------------------------------------------------


def _replica_nest(rid, shared, var):
    """A nest as replica ``rid`` would return it from ``run``."""
    return {
        "loss": np.float64(rid) + 0.5,
        "outs": [np.full(2, rid), (shared, Pair(np.arange(rid + 1), var.get(rid)))],
        "meta": Pair(first=shared, second={"k": [rid * 10]}),
        "none": None,
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_regroup_select_replica_round_trip(n):
    shared = object()
    var = _Var({r: np.full(3, float(r)) for r in range(n)})
    index = {r: _replica_nest(r, shared, var) for r in range(n)}
    out = regroup(index)

    assert set(out) == {"loss", "outs", "meta", "none"}
    assert type(out["outs"]) is list and type(out["outs"][1]) is tuple
    assert type(out["meta"]) is Pair and type(out["outs"][1][1]) is Pair
    assert out["outs"][1][0] is shared and out["meta"].first is shared
    assert out["none"] is None
    assert out["outs"][1][1].second is var

    if n == 1:
        assert not any(isinstance(leaf, PerReplica) for leaf in flatten(out))
    else:
        loss = out["loss"]
        assert type(loss) is PerReplica and loss.replica_ids == tuple(range(n))
        assert [float(v) for v in loss.values] == [r + 0.5 for r in range(n)]
        assert type(out["meta"].second["k"][0]) is PerReplica

    for r in range(n):
        back = select_replica(r, out)
        original = index[r]
        same = map_structure(lambda a, b: a is b or (a == b), back, original)
        assert all(np.all(x) for x in flatten(same)), (r, back, original)
        np.testing.assert_array_equal(back["outs"][0], original["outs"][0])
        assert back["outs"][1][1].second is var.get(r)


def test_one_replica_plain_nest_comes_back_unchanged():
    nest = [1, ("a", {"b": Pair(2.0, None)}), {"z": [3]}]
    out = regroup({0: nest})
    assert out == nest
    assert type(out[1][1]["b"]) is Pair
    arr = np.arange(3)
    assert regroup({7: arr}) is arr
    assert regroup({7: [arr]})[0] is arr


def test_regroup_orders_by_replica_id_and_uses_wrap_class():
    out = regroup({2: "c", 0: "a", 1: "b"}, wrap_class=Mirrored)
    assert type(out) is Mirrored
    assert out.replica_ids == (0, 1, 2) and out.values == ("a", "b", "c")


def test_regroup_keeps_dict_keys_and_order():
    out = regroup({0: {"b": 1, "a": 2}, 1: {"a": 3, "b": 1}})
    assert list(out) == ["b", "a"]
    assert out["b"] == 1
    assert out["a"].values == (2, 3)


def test_regroup_distributed_values_identical_across_replicas_returned_as_is():
    m = Mirrored({0: np.zeros(2), 1: np.zeros(2)})
    pr = PerReplica({0: 1, 1: 2})
    out = regroup({0: [m, pr], 1: [m, pr]})
    assert out[0] is m and out[1] is pr
    other = Mirrored({0: 1, 1: 1})
    wrapped = regroup({0: m, 1: other})
    assert type(wrapped) is PerReplica and wrapped.values[0] is m and wrapped.values[1] is other


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_regroup_components_return_their_variable(n):
    var = _Var({r: np.full(2, r) for r in range(n)})
    assert regroup({r: var.get(r) for r in range(n)}) is var
    assert regroup({r: [var.get(r), (var.get(r),)] for r in range(n)}) == [var, (var,)]


def test_regroup_components_not_lined_up_are_wrapped():
    var = _Var({0: np.zeros(1), 1: np.ones(1)})
    swapped = regroup({0: var.get(1), 1: var.get(0)})
    assert type(swapped) is PerReplica and swapped.values == (var.get(1), var.get(0))
    other = _Var({0: np.zeros(1), 1: np.ones(1)})
    mixed = regroup({0: var.get(0), 1: other.get(1)})
    assert type(mixed) is PerReplica
    partial = regroup({0: var.get(0), 1: np.ones(1)})
    assert type(partial) is PerReplica


def test_regroup_component_of_larger_container():
    var = _Var({0: np.zeros(1), 1: np.ones(1)})
    assert regroup({1: var.get(1)}) is var


def test_regroup_wrap_identical():
    arr = np.arange(2)
    m = Mirrored({3: arr})
    var = _Var({3: np.zeros(1)})
    out = regroup({3: [arr, None, m, var.get(3)]}, wrap_identical=lambda x: isinstance(x, np.ndarray))
    assert type(out[0]) is PerReplica and out[0].get(3) is arr
    assert out[1] is None and out[2] is m and out[3] is var


@pytest.mark.parametrize(
    "index, fragments",
    [
        ({0: [1, 2], 1: [1, 2, 3]}, ["replica 0 and replica 1", "at top level: list of 2 vs list of 3"]),
        (
            {0: [1, {"b": [1]}], 3: [1, {"b": [1]}], 4: [1, {"b": (1,)}]},
            ["replica 0 and replica 4", "at [1]['b']: list of 1 vs tuple of 1"],
        ),
        ({0: {"a": 1}, 1: {"b": 1}}, ["replica 0 and replica 1", "only in the first: ['a']"]),
        ({0: Pair(1, 2), 1: (1, 2)}, ["Pair (namedtuple) of 2 vs tuple of 2"]),
        ({0: (1, [2]), 1: (1, 2)}, ["at [1]: list of 1 vs leaf of type int"]),
    ],
)
def test_regroup_structure_mismatch_raises_value_error(index, fragments):
    with pytest.raises(ValueError) as info:
        regroup(index)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("index, exc", [({}, ValueError), ({"a": 1}, TypeError), (None, TypeError)])
def test_regroup_rejects_bad_index(index, exc):
    with pytest.raises(exc):
        regroup(index)


def test_select_replica_leaves_plain_values_alone():
    arr = np.arange(2)
    m = Mirrored({0: 1.0, 1: 1.0})
    nest = (arr, [PerReplica({0: "x", 1: "y"}), m], {"p": Pair(None, 3)})
    out = select_replica(1, nest)
    assert out[0] is arr and out[1] == ["y", 1.0] and out[2] == {"p": Pair(None, 3)}
    assert select_replica(None, PerReplica({4: "only"})) == "only"
    with pytest.raises(ValueError, match="replica 2 is not local"):
        select_replica(2, nest)


def test_select_replica_mirrored():
    m = Mirrored({0: 1, 1: 2})
    sub = _MirroredSub({0: 3, 1: 4})
    assert select_replica_mirrored(1, [m, {"s": sub}, 5]) == [2, {"s": 4}, 5]
    with pytest.raises(TypeError) as info:
        select_replica_mirrored(0, [m, {"s": PerReplica({0: "bad", 1: "x"})}])
    msg = str(info.value)
    assert "PerReplica" in msg and "[1]['s']" in msg and "'bad'" in msg


def test_select_replica_mirrored_rejects_plain_distributed_values():
    with pytest.raises(TypeError, match="DistributedValues"):
        select_replica_mirrored(0, DistributedValues({0: 1}))
    with pytest.raises(TypeError, match="_Var"):
        select_replica_mirrored(0, (_Var({0: np.zeros(1)}),))


def test_module_all():
    assert sorted(_values.__all__) == sorted(
        [
            "ComponentOperators",
            "DistributedValues",
            "PerReplica",
            "Mirrored",
            "regroup",
            "select_replica",
            "select_replica_mirrored",
        ]
    )
    for name in _values.__all__:
        assert getattr(_values, name).__doc__


# --------------------------------------------------------------------------
# get() in replica context, conversion of PerReplica
# --------------------------------------------------------------------------


class _StandInStrategy:
    """What the context stack needs of a strategy: an identity."""


@pytest.mark.parametrize("size", [1, 2, 3])
def test_get_without_id_in_replica_context_is_the_current_replicas(size):
    from mpidist._distribute.context import ReplicaContext, enter_context

    strategy = _StandInStrategy()
    pr = PerReplica({q: np.full(2, 10.0 * q) for q in range(size)})
    m = Mirrored({q: np.arange(3.0) + q for q in range(size)})
    for replica in range(size):
        with enter_context(strategy, ReplicaContext(strategy, replica)):
            np.testing.assert_array_equal(pr.get(), np.full(2, 10.0 * replica))
            np.testing.assert_array_equal(m + 1, np.arange(3.0) + replica + 1)
            np.testing.assert_array_equal(np.asarray(pr), np.full(2, 10.0 * replica))
            assert select_replica(None, {"x": pr})["x"] is pr.get(replica)
        with enter_context(strategy):  # cross-replica context: no current replica
            if size > 1:
                with pytest.raises(ValueError, match=re.escape(f"replicas {list(range(size))}") + ".*pass replica_id"):
                    pr.get()
            else:
                assert pr.get() is pr.get(0)
    with enter_context(strategy, ReplicaContext(strategy, size)):  # a replica this value has no component of
        if size > 1:
            with pytest.raises(ValueError, match=rf"replica {size} is not local; local replicas: "):
                pr.get()


def test_numpy_asarray_of_per_replica_is_the_local_component():
    component = np.arange(3.0)
    pr = PerReplica({2: component})
    view = np.asarray(pr)
    assert type(view) is np.ndarray and view.dtype == np.float64 and np.shares_memory(view, component)
    assert np.asarray(pr, dtype=np.int8).dtype == np.int8
    assert not np.shares_memory(np.array(pr, copy=True), component)
    np.testing.assert_array_equal(np.from_dlpack(pr), component)
    assert not hasattr(pr, "__cuda_array_interface__")
    assert PerReplica({0: _DeviceArrayLike()}).__cuda_array_interface__ is _DeviceArrayLike.__cuda_array_interface__
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(PerReplica({0: _DeviceArrayLike()}))
    with pytest.raises(ValueError, match="pass replica_id"):  # never an object array
        np.asarray(PerReplica({0: 1.0, 1: 2.0}))
    assert not hasattr(pr, "shape")  # conversion only: PerReplica is not a delegate
    with pytest.raises(TypeError):
        pr + 1
