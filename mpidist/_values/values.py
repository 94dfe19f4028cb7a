"""Distributed values: per-replica and mirrored values, ``regroup``, ``select_replica``.

A *distributed value* has one component per replica. Under MPI a replica is a
rank, and each rank holds only its own component, so a distributed value on
rank ``r`` is simply ``{r: component}``; in serial code (tests, one process
simulating several replicas) one object may hold several components.

- :class:`PerReplica`: components that are not synchronized (each replica's
  batch, loss, gradients). Not usable as the component itself.
- :class:`Mirrored`: components kept identical on all replicas. It behaves
  like its local component: attribute access, Python operators, indexing,
  ``len``/``iter``/``bool``/``float``, ``numpy.asarray`` and the CUDA array
  interface / DLPack protocols all go to the local component.
- :func:`regroup` turns ``{replica id: nest}`` into one nest of distributed
  values (what ``strategy.run`` returns); :func:`select_replica` undoes it
  for one replica (what ``strategy.run`` passes to the replica function).

Components of distributed *variables* are mapped back to their variable by
:func:`regroup`. The variables layer makes that possible by calling
:func:`register_component` for every component it creates; the registry
holds only weak references to the variables.

Everything in this module is local: no function or method here communicates
with other ranks. This layer does not import MPI.
"""

from __future__ import annotations

import collections.abc
import operator
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

from mpidist._values.nest import assert_same_structure, map_structure, map_structure_with_path

__all__ = [
    "ComponentOperators",
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "regroup",
    "select_replica",
    "select_replica_mirrored",
]

_NUMPY2 = int(numpy.__version__.split(".")[0]) >= 2


# --------------------------------------------------------------------------
# Replica ids
# --------------------------------------------------------------------------


def _as_replica_id(value: Any, what: str = "replica id") -> int:
    """``value`` as a non-negative ``int`` (NumPy integers accepted, ``bool`` rejected)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an int (a rank), got {value!r} of type {type(value).__name__}")
    rid = operator.index(value)
    if rid < 0:
        raise ValueError(f"{what} must be >= 0 (a rank), got {rid}")
    return rid


def _normalize_index(index: Mapping[int, Any], owner: str) -> dict[int, Any]:
    """A copy of ``index`` with int keys, ordered by replica id; rejects empty/non-int indexes."""
    if type(index) is dict and len(index) == 1:  # under MPI: {rank: value}, on every call of the hot path
        ((key, value),) = index.items()
        if type(key) is int and key >= 0:
            return {key: value}
    if not isinstance(index, collections.abc.Mapping):
        raise TypeError(f"{owner} expects a mapping from replica id to value, got {type(index).__name__}")
    if len(index) == 0:
        raise ValueError(f"{owner} needs at least one replica, got an empty index")
    out: dict[int, Any] = {}
    for key, value in index.items():
        rid = _as_replica_id(key, what=f"{owner}: replica id (index key)")
        if rid in out:
            raise ValueError(f"{owner}: replica id {rid} appears twice in the index")
        out[rid] = value
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------
# DistributedValues, PerReplica
# --------------------------------------------------------------------------


class DistributedValues:
    """One component per replica, for the replicas local to this process.

    Args:
        index: maps replica id (an ``int``, the rank under MPI) to that
            replica's component. Under MPI this is ``{rank: value}``.

    Converting a distributed value to an array (``numpy.asarray(v)``, and
    the CUDA array interface / DLPack protocols where the component is on a
    GPU) gives the local component, as :meth:`get` does. Conversion is
    always local: it never communicates.

    Raises:
        ValueError: ``index`` is empty.
        TypeError: ``index`` is not a mapping, or a key is not an ``int``.
    """

    def __init__(self, index: Mapping[int, Any]) -> None:
        self._index: dict[int, Any] = _normalize_index(index, type(self).__name__)

    @property
    def values(self) -> tuple[Any, ...]:
        """The local components, ordered by replica id. Local."""
        return tuple(self._index.values())

    @property
    def replica_ids(self) -> tuple[int, ...]:
        """The ids of the local replicas, matching :attr:`values`. Local."""
        return tuple(self._index)

    def get(self, replica_id: Optional[int] = None) -> Any:
        """The component of replica ``replica_id``. Local: no communication.

        With ``replica_id=None``: the only local component when there is one
        (always the case under MPI, one replica per rank); otherwise, in
        replica context (inside ``strategy.run``), the current replica's.

        Raises:
            ValueError: ``replica_id`` is not local (the message names the
                requested and the local ids), or it is ``None``, several
                components are local and no replica context is active.
        """
        if replica_id is None:
            if len(self._index) == 1:
                return next(iter(self._index.values()))
            replica_id = _current_replica_id()
            if replica_id is None:
                raise ValueError(
                    f"{type(self).__name__}.get(): this value holds components for replicas "
                    f"{list(self._index)}; outside replica context pass replica_id to choose one"
                )
        rid = _as_replica_id(replica_id)
        try:
            return self._index[rid]
        except KeyError:
            raise ValueError(
                f"{type(self).__name__}.get(): replica {rid} is not local; local replicas: {list(self._index)}"
            ) from None

    def __repr__(self) -> str:
        index = self.__dict__.get("_index", "<uninitialized>")
        return f"{type(self).__name__}({index!r})"

    __str__ = __repr__

    # -- conversion to arrays (local) ---------------------------------------
    def _convertible(self) -> Any:
        """The component that conversions to arrays use: the local one. Local."""
        return self.get()

    def __array__(self, dtype: Optional[DTypeLike] = None, copy: Optional[bool] = None) -> numpy.ndarray:
        """NumPy's view of the local component (``numpy.asarray(v)``). Local.

        A device (CuPy) component fails here exactly as ``numpy.asarray`` of
        the component itself does: no implicit device-to-host copy.
        """
        component = self._convertible()
        if copy:
            return numpy.array(component, dtype=dtype, copy=True)
        if copy is False and _NUMPY2:
            return numpy.asarray(component, dtype=dtype, copy=False)
        return numpy.asarray(component, dtype=dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        """The local component's CUDA array interface (``AttributeError`` if it has none). Local."""
        return self._convertible().__cuda_array_interface__

    @property
    def __dlpack__(self) -> Callable[..., Any]:
        """The local component's ``__dlpack__`` method (``AttributeError`` if it has none). Local."""
        return self._convertible().__dlpack__

    @property
    def __dlpack_device__(self) -> Callable[[], Any]:
        """The local component's ``__dlpack_device__`` method (``AttributeError`` if none). Local."""
        return self._convertible().__dlpack_device__


def _no_replica_id() -> Optional[int]:
    return None


# The current replica id for get() without an id: None outside replica context. The context
# layer, above this one, installs the real source with set_replica_id_source.
_current_replica_id: Callable[[], Optional[int]] = _no_replica_id


def set_replica_id_source(source: Callable[[], Optional[int]]) -> None:
    """Install the function that tells :meth:`DistributedValues.get` the current replica id. Local."""
    global _current_replica_id
    _current_replica_id = source


class PerReplica(DistributedValues):
    """Unsynchronized values: each replica's component may differ.

    Unlike :class:`Mirrored`, a ``PerReplica`` is not a stand-in for its
    component: it has no operators or attributes of the component. Use
    ``.get()``, ``strategy.run`` (which unwraps it) or
    ``strategy.reduce``/``gather``. ``numpy.asarray`` of it is the local
    component (this rank's value, the SPMD reading of a per-replica value).
    """


# --------------------------------------------------------------------------
# Delegation
# --------------------------------------------------------------------------

# Protocol attributes forwarded to the component (properties of DistributedValues).
_FORWARDED_PROTOCOLS = frozenset({"__cuda_array_interface__", "__dlpack__", "__dlpack_device__"})


def _forward(op: Callable[..., Any]) -> Callable[..., Any]:
    return lambda self, *args: op(self._convertible(), *args)


def _reflect(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda self, other: op(other, self._convertible())


def _power(a: Any, b: Any, modulo: Any = None) -> Any:
    return pow(a, b) if modulo is None else pow(a, b, modulo)


def _round(x: Any, ndigits: Optional[int] = None) -> Any:
    return round(x) if ndigits is None else round(x, ndigits)


# name -> operation on the component; binary ones also get their reflected form (__radd__, ...).
_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "divmod": divmod,
    "matmul": operator.matmul,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
}
_OTHER: dict[str, Callable[..., Any]] = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
    "neg": operator.neg,
    "pos": operator.pos,
    "invert": operator.invert,
    "abs": abs,
    "getitem": operator.getitem,
    "len": len,
    "iter": iter,
    "contains": operator.contains,
    "bool": bool,
    "float": float,
    "int": int,
    "index": operator.index,
    "complex": complex,
    "round": _round,
    "pow": _power,
}


class ComponentOperators(DistributedValues):
    """A distributed value whose Python operators act on the component its conversion gives.

    Arithmetic, comparisons, bitwise and unary operators, indexing,
    ``len``/``iter``/``bool``/numeric conversions use the component that
    ``numpy.asarray`` of the value would (the local one), and return plain
    values. Local; a subclass whose conversion refuses (a sync-on-read
    variable in cross-replica context) refuses its operators alike.
    """

    # Higher than ndarray's, so ``ndarray <op> value`` defers to our
    # reflected operators instead of NumPy converting us itself.
    __array_priority__ = 100.0

    # Defining __eq__ would otherwise make instances unhashable; keep identity
    # hashing so distributed values can be dict keys and set members.
    __hash__ = object.__hash__

    def __rpow__(self, o: Any, modulo: Any = None) -> Any:
        return _power(o, self._convertible(), modulo)


for _name, _op in _BINARY.items():
    setattr(ComponentOperators, f"__{_name}__", _forward(_op))
    setattr(ComponentOperators, f"__r{_name}__", _reflect(_op))
for _name, _op in _OTHER.items():
    setattr(ComponentOperators, f"__{_name}__", _forward(_op))
del _name, _op


class _Delegate(ComponentOperators):
    """A distributed value that acts as its local component.

    Public attribute access (``m.shape``, ``m.sum()``), Python operators,
    indexing, ``len``/``iter``/``bool``/numeric conversions and the array
    protocols go to :meth:`get` (the local component). All of it is local.

    Names that start with ``_`` are not delegated, so that ``copy``,
    ``pickle`` and NumPy's protocol probes see the container, never the
    component (and nothing recurses before ``_index`` is set).
    """

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup failed.
        if name.startswith("_"):
            detail = ""
            if name in _FORWARDED_PROTOCOLS:
                index = self.__dict__.get("_index")
                if index is not None and len(index) == 1:
                    comp = next(iter(index.values()))
                    detail = f" (its local component, of type {type(comp).__name__}, has none)"
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{detail}")
        if "_index" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (not initialized)")
        return getattr(self.get(), name)

    def __format__(self, spec: str) -> str:
        if not spec:
            return str(self)
        return format(self.get(), spec)


class Mirrored(_Delegate):
    """Values kept identical on all replicas; usable as the local component.

    ``m + 1``, ``m.shape``, ``m[1:]``, ``numpy.asarray(m)`` all act on the
    local component and return plain values (NumPy/CuPy arrays), not
    ``Mirrored``. In-place operators (``m += 1``) rebind the name to the plain
    result instead of changing the component, so a ``Mirrored`` never drifts
    out of sync by local mutation. Everything here is local.
    """


# --------------------------------------------------------------------------
# Registry of variable components
# --------------------------------------------------------------------------

# id(component) -> (weak reference to its container, replica id)
_registry: dict[int, tuple[weakref.ref[DistributedValues], int]] = {}

# Immutable builtins may be shared objects (small ints, interned strings): an
# id-keyed registry would mistake unrelated values for components.
_UNREGISTRABLE = (type(None), bool, int, float, complex, str, bytes, tuple)


def register_component(container: DistributedValues, replica_id: int, component: Any) -> None:
    """Record that ``component`` is ``container``'s component of replica ``replica_id``.

    For the variables layer: after this, :func:`regroup` maps the component
    (on every replica) back to ``container``. The registry keeps only a weak
    reference to ``container`` and drops the entry when ``container`` is
    garbage collected. Local: no communication.

    Raises:
        TypeError: ``container`` is not a :class:`DistributedValues`, or
            ``component`` is an immutable builtin (``int``, ``str``, ...),
            which may be shared with unrelated code.
    """
    if not isinstance(container, DistributedValues):
        raise TypeError(f"register_component: container must be a DistributedValues, got {type(container).__name__}")
    rid = _as_replica_id(replica_id)
    if isinstance(component, _UNREGISTRABLE):
        raise TypeError(
            f"register_component: a component must be an object owned by its container "
            f"(an array), not a {type(component).__name__}"
        )
    key = id(component)
    ref = weakref.ref(container)
    _registry[key] = (ref, rid)
    fin = weakref.finalize(container, _forget_component, key, ref)
    fin.atexit = False


def renumber_replica(container: DistributedValues, replica_id: int) -> None:
    """Record that ``container``'s one local component is now replica ``replica_id``'s.

    For the variables layer, after the replicas were renumbered (ranks died
    and the survivors carry on in their old order): the container keeps its
    component, under its new replica id. Local: no communication.

    Raises:
        ValueError: ``container`` holds more than one component.
    """
    if len(container._index) != 1:
        raise ValueError(f"renumber_replica: {type(container).__name__} holds {len(container._index)} components")
    component = next(iter(container._index.values()))
    container._index = {_as_replica_id(replica_id): component}
    register_component(container, replica_id, component)


def _forget_component(key: int, ref: weakref.ref[DistributedValues]) -> None:
    entry = _registry.get(key)
    if entry is not None and entry[0] is ref:
        _registry.pop(key, None)


def _owner_of(obj: Any) -> Optional[tuple[DistributedValues, int]]:
    """``(container, replica_id)`` if ``obj`` is a registered, current component, else ``None``.

    Verifies that the container is alive and still holds this very object at
    that replica id (``id()`` values are reused after objects die). Local.
    """
    entry = _registry.get(id(obj))
    if entry is None:
        return None
    ref, rid = entry
    container = ref()
    if container is None:
        return None
    index = container.__dict__.get("_index")
    if index is None or rid not in index or index[rid] is not obj:
        return None
    return container, rid


# --------------------------------------------------------------------------
# regroup / select_replica
# --------------------------------------------------------------------------


def _regroup_leaf(
    ids: tuple[int, ...],
    leaves: tuple[Any, ...],
    wrap_class: Callable[[Mapping[int, Any]], Any],
    wrap_identical: Optional[Callable[[Any], bool]],
) -> Any:
    first = leaves[0]
    # Components of one distributed variable, each at its own replica id.
    owner = _owner_of(first)
    if owner is not None:
        container = owner[0]
        for rid, leaf in zip(ids, leaves):
            o = _owner_of(leaf)
            if o is None or o[0] is not container or o[1] != rid:
                break
        else:
            return container
    # The same object everywhere: return it as is (unless wrap_identical asks to wrap it).
    if all(leaf is first for leaf in leaves[1:]) and (
        isinstance(first, DistributedValues) or wrap_identical is None or not wrap_identical(first)
    ):
        return first
    return wrap_class(dict(zip(ids, leaves)))


def regroup(
    index: Mapping[int, Any],
    wrap_class: Callable[[Mapping[int, Any]], Any] = PerReplica,
    *,
    wrap_identical: Optional[Callable[[Any], bool]] = None,
) -> Any:
    """Turn ``{replica id: nest}`` into one nest of distributed values. Local.

    The nests (lists, tuples, namedtuples, dicts) must have the same
    structure; the result has that structure (a namedtuple keeps its type,
    dicts keep their keys). Each leaf position becomes:

    - the distributed variable itself, when every replica's leaf is that
      variable's component for that replica (see :func:`register_component`);
    - the leaf itself, when it is the same object on every replica (so with
      one replica a nest of plain values comes back unchanged, and a
      distributed value shared by all replicas comes back as it is);
    - otherwise ``wrap_class({replica id: leaf})`` (``PerReplica`` by default).

    Args:
        index: replica id -> that replica's nest.
        wrap_class: what to wrap differing leaves in (``PerReplica``, ``Mirrored``).
        wrap_identical: optional predicate; a leaf that is the same object on
            every replica is wrapped anyway when ``wrap_identical(leaf)`` is
            true (distributed values are never wrapped). Under MPI each rank
            regroups only its own replica, so every leaf is trivially "the
            same on every replica"; pass e.g. a test for arrays to get
            ``PerReplica`` arrays there.

    Raises:
        ValueError: the nests differ in structure (the message names the
            path and the two replica ids), or ``index`` is empty.
    """
    per_replica = _normalize_index(index, "regroup")
    ids = tuple(per_replica)
    nests = tuple(per_replica.values())
    for rid, nest in zip(ids[1:], nests[1:]):
        try:
            assert_same_structure(nests[0], nest)
        except ValueError as e:
            raise ValueError(f"regroup: the nests of replica {ids[0]} and replica {rid} differ: {e}") from None
    return map_structure(lambda *leaves: _regroup_leaf(ids, leaves, wrap_class, wrap_identical), *nests)


def select_replica(replica_id: Optional[int], nest: Any) -> Any:
    """The nest as replica ``replica_id`` sees it: undoes :func:`regroup`. Local.

    Every :class:`DistributedValues` leaf is replaced by its component
    ``.get(replica_id)`` (``None``: the local component); other leaves are
    returned unchanged.
    """

    def pick(x: Any) -> Any:
        return x.get(replica_id) if isinstance(x, DistributedValues) else x

    return map_structure(pick, nest)


def select_replica_mirrored(replica_id: Optional[int], nest: Any) -> Any:
    """Like :func:`select_replica`, but only :class:`Mirrored` values are allowed. Local.

    Raises:
        TypeError: the nest holds a :class:`DistributedValues` that is not a
            ``Mirrored`` (a ``PerReplica``, say); the message names the value
            and its path in the nest.
    """

    def pick(path: str, x: Any) -> Any:
        if not isinstance(x, DistributedValues):
            return x
        if not isinstance(x, Mirrored):
            raise TypeError(
                f"select_replica_mirrored: expected values mirrored across replicas, but "
                f"found a {type(x).__name__} at {path or 'top level'}: {x!r}"
            )
        return x.get(replica_id)

    return map_structure_with_path(pick, nest)
