"""Nest utilities: functions over nested lists, tuples, namedtuples and dicts.

A *nest* is a leaf or a list, tuple, namedtuple or dict whose items are nests.
Everything that is not a list, tuple or dict is a leaf: arrays, numbers,
strings, ``None``, distributed values, sets, other mappings.

Rebuilt nests keep their container type: a namedtuple comes back as the same
namedtuple type, a dict as a dict with the same keys (in the key order of the
structure it was built from). Flattening visits dict items in sorted key order
when the keys are sortable, else in insertion order, so ``flatten`` and
``pack_sequence_as`` agree with each other for any dict.

All functions here are local: they touch no communicator and no other rank.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import numpy as np

__all__ = [
    "assert_same_structure",
    "flatten",
    "is_number",
    "leaf_paths",
    "map_structure",
    "map_structure_with_path",
    "pack_sequence_as",
]


# --------------------------------------------------------------------------
# Node classification
# --------------------------------------------------------------------------


def is_number(x: Any) -> bool:
    """A number leaf: a Python or NumPy scalar other than ``bool`` (a flag). Local."""
    return isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, bool)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields") and hasattr(type(x), "_make")


def _is_nest_node(x: Any) -> bool:
    return isinstance(x, (list, tuple, dict))


def _kind(x: Any) -> Any:
    """What two nodes must share to have the same structure at this level."""
    if isinstance(x, dict):
        return dict
    if _is_namedtuple(x):
        return type(x)
    if isinstance(x, tuple):
        return tuple
    if isinstance(x, list):
        return list
    return None  # a leaf


def _dict_keys(d: dict) -> list[Any]:
    """Keys in traversal order: sorted when sortable, else insertion order."""
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _children(x: Any) -> list[tuple[str, Any]]:
    """``(path piece, child)`` pairs of a nest node, in traversal order."""
    if isinstance(x, dict):
        return [(f"[{k!r}]", x[k]) for k in _dict_keys(x)]
    if _is_namedtuple(x):
        return [(f".{name}", v) for name, v in zip(type(x)._fields, x)]
    return [(f"[{i}]", v) for i, v in enumerate(x)]


def _rebuild(like: Any, items: Sequence[Any]) -> Any:
    """A node of the same type as ``like`` whose children, in traversal order, are ``items``."""
    if isinstance(like, dict):
        by_key = dict(zip(_dict_keys(like), items))
        pairs = [(k, by_key[k]) for k in like]  # keep the structure's own key order
        if type(like) is dict:
            return dict(pairs)
        if isinstance(like, defaultdict):
            return type(like)(like.default_factory, pairs)
        try:
            return type(like)(pairs)
        except TypeError:
            return dict(pairs)
    if _is_namedtuple(like):
        return type(like)._make(items)
    if type(like) in (list, tuple):
        return type(like)(items)
    try:
        return type(like)(items)
    except TypeError:
        return list(items) if isinstance(like, list) else tuple(items)


def _describe(x: Any) -> str:
    """Short description of a node for error messages: ``list of 3``."""
    if isinstance(x, dict):
        return f"{type(x).__name__} with keys {_dict_keys(x)!r}"
    if _is_namedtuple(x):
        return f"{type(x).__name__} (namedtuple) of {len(x)}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of {len(x)}"
    return f"leaf of type {type(x).__name__}"


def _where(path: str) -> str:
    return path if path else "top level"


def _mismatch(a: Any, b: Any, path: str = "") -> Optional[str]:
    """``None`` if ``a`` and ``b`` have the same structure, else a message naming the path."""
    ka, kb = _kind(a), _kind(b)
    if ka is None and kb is None:
        return None
    if ka is not kb:
        return f"structure mismatch at {_where(path)}: {_describe(a)} vs {_describe(b)}"
    if ka is dict:
        if a.keys() != b.keys():
            only_a = _dict_keys({k: None for k in a if k not in b})
            only_b = _dict_keys({k: None for k in b if k not in a})
            return (
                f"structure mismatch at {_where(path)}: {_describe(a)} vs {_describe(b)} "
                f"(only in the first: {only_a!r}; only in the second: {only_b!r})"
            )
    elif len(a) != len(b):
        return f"structure mismatch at {_where(path)}: {_describe(a)} vs {_describe(b)}"
    if ka is dict:
        pairs = [(f"[{k!r}]", a[k], b[k]) for k in _dict_keys(a)]
    else:
        pairs = [(piece, child_a, b[i]) for i, (piece, child_a) in enumerate(_children(a))]
    for piece, child_a, child_b in pairs:
        msg = _mismatch(child_a, child_b, path + piece)
        if msg is not None:
            return msg
    return None


# --------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------


def assert_same_structure(a: Any, b: Any) -> None:
    """Raise ``ValueError`` unless nests ``a`` and ``b`` have the same structure.

    Same structure means: the same container kind at every position (list,
    plain tuple, the same namedtuple type, dict), the same lengths and the
    same dict keys. Leaves may differ freely. The message names the first
    path where the nests differ, e.g. ``structure mismatch at [1]['b']: list
    of 2 vs list of 3``. Local: no communication.
    """
    msg = _mismatch(a, b)
    if msg is not None:
        raise ValueError(msg)


def _iter_leaves(nest: Any) -> Iterator[Any]:
    if _is_nest_node(nest):
        for _, child in _children(nest):
            yield from _iter_leaves(child)
    else:
        yield nest


def flatten(nest: Any) -> list[Any]:
    """The leaves of ``nest`` in traversal order (a leaf gives ``[leaf]``). Local."""
    return list(_iter_leaves(nest))


def leaf_paths(nest: Any) -> list[str]:
    """The path of each leaf of ``nest``, in traversal order: ``["['acc']", "['loss']"]``; ``[""]`` for a leaf.

    The paths name dict keys, namedtuple fields and list or tuple indices, so
    two nests have the same paths exactly when they have the same keys in the
    same places (a list and a tuple of the same length share theirs). Local.
    """
    if not _is_nest_node(nest):
        return [""]
    paths: list[str] = []
    _collect_paths(nest, "", paths)
    return paths


def _collect_paths(node: Any, path: str, paths: list[str]) -> None:
    for piece, child in _children(node):
        if _is_nest_node(child):
            _collect_paths(child, path + piece, paths)
        else:
            paths.append(path + piece)


def pack_sequence_as(structure: Any, flat: Sequence[Any]) -> Any:
    """Rebuild ``structure`` with its leaves replaced, in order, by ``flat``.

    The inverse of :func:`flatten`: ``pack_sequence_as(s, flatten(s)) == s``.
    Raises ``ValueError`` when ``flat`` has a different number of items than
    ``structure`` has leaves. Local: no communication.
    """
    flat = list(flat)
    n_leaves = sum(1 for _ in _iter_leaves(structure))
    if n_leaves != len(flat):
        raise ValueError(
            f"pack_sequence_as: the structure has {n_leaves} leaves but the flat sequence has {len(flat)} items"
        )
    return _pack(structure, iter(flat))


# The recursive helpers are module functions, not closures: a recursive closure is a reference
# cycle, and the leaves it holds would wait for the garbage collector instead of being freed at once.
def _pack(node: Any, leaves: Iterator[Any]) -> Any:
    """``node`` rebuilt with its leaves taken, in order, from ``leaves``."""
    if not _is_nest_node(node):
        return next(leaves)
    return _rebuild(node, [_pack(child, leaves) for _, child in _children(node)])


def map_structure_with_path(fn: Callable[..., Any], *nests: Any) -> Any:
    """Like :func:`map_structure`, but ``fn(path, *leaves)`` also gets the leaf's path.

    ``path`` is a string such as ``"[1]['b'].x"`` (list index, dict key,
    namedtuple field); it is ``""`` for a nest that is itself a leaf. Local.
    """
    if not nests:
        raise TypeError("map_structure needs at least one nest")
    first = nests[0]
    for other in nests[1:]:
        assert_same_structure(first, other)
    return _map_with_path(fn, "", nests)


def _map_with_path(fn: Callable[..., Any], path: str, nodes: tuple[Any, ...]) -> Any:
    """``fn(path, *leaves)`` over nodes of the same structure (see :func:`_pack` for why not a closure)."""
    head = nodes[0]
    if not _is_nest_node(head):
        return fn(path, *nodes)
    if isinstance(head, dict):
        results = [_map_with_path(fn, path + f"[{k!r}]", tuple(n[k] for n in nodes)) for k in _dict_keys(head)]
    else:
        pieces = [piece for piece, _ in _children(head)]
        results = [_map_with_path(fn, path + pieces[i], tuple(n[i] for n in nodes)) for i in range(len(head))]
    return _rebuild(head, results)


def map_structure(fn: Callable[..., Any], *nests: Any) -> Any:
    """Apply ``fn`` to the leaves of one or more nests of the same structure.

    ``fn`` is called once per leaf position with the leaves of all nests at
    that position; the result has the structure (and container types) of the
    first nest. Raises ``ValueError`` naming the path where two nests differ.
    Local: no communication.
    """
    if not nests:
        raise TypeError("map_structure needs at least one nest")
    first = nests[0]
    for other in nests[1:]:
        assert_same_structure(first, other)
    return _map(fn, nests)


def _map(fn: Callable[..., Any], nodes: tuple[Any, ...]) -> Any:
    """``fn(*leaves)`` over nodes of the same structure (see :func:`_pack` for why not a closure)."""
    head = nodes[0]
    if type(head) in (list, tuple) or (isinstance(head, (list, tuple)) and not _is_namedtuple(head)):
        return _rebuild(head, [_map(fn, tuple(n[i] for n in nodes)) for i in range(len(head))])
    if isinstance(head, dict):
        return _rebuild(head, [_map(fn, tuple(n[k] for n in nodes)) for k in _dict_keys(head)])
    if _is_namedtuple(head):
        return type(head)._make([_map(fn, tuple(n[i] for n in nodes)) for i in range(len(head))])
    return fn(*nodes)
