"""Checking a manifest whole before anything is allocated or read. Pure, no MPI.

A manifest is JSON text; a reader checks every field it will use (type,
range, known values) here, before it opens a data file, allocates an array
or reads a byte. Element and byte counts are Python ints (they cannot
overflow); what they declare is later compared with the real sizes of the
files (:mod:`mpidist._checkpoint.reader`), so the work a reader does is
bounded by the size of the save on disk. The limits below also bound the
manifest itself: its size, the nesting depth of its JSON and the number of
dimensions of an array; :meth:`Checkpoint.save` refuses to write a
manifest outside them.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from typing import TYPE_CHECKING, Any

from mpidist._checkpoint.format import (
    ARRAY_KINDS,
    BFLOAT16,
    BFLOAT16_VERSION,
    BLOCK_BYTES_KEY,
    BLOCK_CRCS_KEY,
    FORMAT,
    FORMAT_VERSION,
    MIRRORED,
    NONFINITE,
    NONFINITE_VALUES,
    NONFINITE_VERSION,
    STATE,
    SYNC_ON_READ,
    block_count,
    canonical,
    dtype_label,
    is_data_file_name,
    spell_dtype,
    stored_dtype,
)
from mpidist._distribute.variables import VariableAggregation
from mpidist._errors import CheckpointError, ChecksumError
from mpidist._version import __version__

if TYPE_CHECKING:  # typing.TypeGuard is Python 3.10
    from typing import TypeGuard

__all__ = ["MAX_DEPTH", "MAX_MANIFEST_BYTES", "decode_manifest", "state_fits"]

MAX_MANIFEST_BYTES = 64 << 20
MAX_DEPTH = 64
MAX_DIMS = 64
MAX_HEADER_BYTES = 1 << 16
_MAX_WORLD = (1 << 31) - 1
_MAX_BLOCK = 1 << 40
_MAX_TEXT = 4096
_AGGREGATIONS = frozenset(a.value for a in VariableAggregation)
# What dtype.str looks like for NumPy's dtypes a checkpoint holds: byte order, kind, item size, datetime unit
# (bfloat16 is spelled BFLOAT16).
_DTYPE_RE = re.compile(r"^[<>|=][biufcmM][0-9]{1,2}(\[[0-9]{0,4}[A-Za-z]{1,2}\])?$")


def json_depth(obj: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 1, ``[[]]`` is 2), computed without recursion. Local."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def decode_manifest(data: bytes, where: str) -> dict:
    """Parse and check a manifest (JSON only, nothing is executed). Local.

    Raises:
        ChecksumError: the text is not JSON, or does not match its CRC-32
            (damaged after it was written).
        CheckpointError: a well-formed manifest asks for something a reader
            refuses (a field of the wrong type or out of range, an unknown
            kind, aggregation or dtype, a file outside the save, sizes that
            do not add up, nesting or size beyond the limits).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{where}: the manifest has {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a "
            "reader accepts; this is not a manifest written by mpidist"
        )
    try:
        manifest = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChecksumError(f"{where}: not a valid manifest ({exc}); the checkpoint is damaged", file=where) from None
    except (RecursionError, MemoryError):
        raise CheckpointError(f"{where}: malformed manifest (nested deeper than {MAX_DEPTH} levels)") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: malformed manifest (a JSON {type(manifest).__name__}, not an object)")
    if json_depth(manifest) > MAX_DEPTH:
        raise CheckpointError(f"{where}: malformed manifest (nested deeper than {MAX_DEPTH} levels)")
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    if manifest.get("manifest_crc32") != zlib.crc32(canonical(body)):
        raise ChecksumError(
            f"{where}: the manifest does not match its checksum; it was altered or damaged after it was written",
            file=where,
        )
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not an mpidist checkpoint manifest")
    version = manifest.get("format_version")
    if _is_int(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format version {version} is newer than this mpidist "
            f"({__version__}) reads ({FORMAT_VERSION}); upgrade mpidist"
        )
    try:
        check_manifest(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed manifest ({_describe(exc)})") from None
    return manifest


def check_manifest(manifest: dict) -> None:
    """Raise ``ValueError`` (``KeyError`` for a missing field) unless a reader can use ``manifest`` safely. Local."""
    version = _need(manifest, "format_version", lambda v: _is_int(v) and 1 <= v <= FORMAT_VERSION)
    _need(manifest, "checksum", lambda v: v == "crc32")
    for key in ("created", "mpidist_version"):
        _need(manifest, key, lambda v: isinstance(v, str) and len(v) <= _MAX_TEXT)
    world = _need(manifest, "world_size", lambda v: _is_int(v) and 1 <= v <= _MAX_WORLD)
    block = _need(manifest, BLOCK_BYTES_KEY, lambda v: _is_int(v) and 1 <= v <= _MAX_BLOCK)
    entries = _need(manifest, "entries", lambda v: isinstance(v, list))
    names: set[str] = set()
    files: set[str] = set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"entry {index} is a JSON {type(entry).__name__}, not an object")
        name = _need(entry, "name", lambda v: isinstance(v, str) and 0 < len(v) <= _MAX_TEXT)
        if name in names:
            raise ValueError(f"two entries are named {name!r}")
        names.add(name)
        kind = entry.get("kind")
        if kind == STATE:
            _check_state(entry, world, version)
        elif kind in ARRAY_KINDS:
            _check_array(entry, block, files, version)
        else:
            raise ValueError(f"entry {name!r} has unknown kind {kind!r}")


def _check_state(entry: dict, world: int, version: int) -> None:
    name = entry["name"]
    if ("state" in entry) == ("rank_states" in entry):
        raise ValueError(f"state entry {name!r} needs exactly one of 'state' and 'rank_states'")
    if "rank_states" in entry:
        _need(entry, "rank_states", lambda v: isinstance(v, list) and len(v) == world)
    if NONFINITE in entry:
        if version < NONFINITE_VERSION:
            raise ValueError(f"entry {name!r} marks NaN or infinities, which format version {version} cannot hold")
        for mark in _need(entry, NONFINITE, lambda v: isinstance(v, list) and len(v) > 0):
            _check_nonfinite_mark(entry, mark)


def _check_nonfinite_mark(entry: dict, mark: Any) -> None:
    """``ValueError`` unless ``mark`` is ``[path, spelling]`` whose path leads to a null of the entry's state."""
    name = entry["name"]
    if not (
        isinstance(mark, list)
        and len(mark) == 2
        and isinstance(mark[0], list)
        and mark[0]
        and isinstance(mark[1], str)
        and mark[1] in NONFINITE_VALUES
    ):
        raise ValueError(f"entry {name!r}: unusable non-finite mark {_short(mark)}")
    path = mark[0]
    if path[0] not in ("state", "rank_states"):
        raise ValueError(f"entry {name!r}: non-finite mark {_short(path)} is not inside the state")
    holder: Any = entry
    for step in path:
        key = isinstance(holder, dict) and isinstance(step, str) and step in holder
        if not (key or (isinstance(holder, list) and _is_int(step) and 0 <= step < len(holder))):
            raise ValueError(f"entry {name!r}: non-finite mark {_short(path)} leads nowhere")
        holder = holder[step]
    if holder is not None:
        raise ValueError(f"entry {name!r}: non-finite mark {_short(path)} is not at a null")


def _check_array(entry: dict, block: int, files: set[str], version: int) -> None:
    name, kind = entry["name"], entry["kind"]
    descr = _need(entry, "dtype", lambda v: isinstance(v, str) and (v == BFLOAT16 or _DTYPE_RE.match(v) is not None))
    if descr == BFLOAT16 and version < BFLOAT16_VERSION:
        raise ValueError(f"entry {name!r} is bfloat16, which format version {version} cannot hold")
    try:
        spell_dtype(descr, name)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    dtype, label = stored_dtype(descr), dtype_label(descr)
    shape = _need(
        entry,
        "shape",
        lambda v: isinstance(v, list) and len(v) <= MAX_DIMS and all(_is_int(s) and 0 <= s < 1 << 63 for s in v),
    )
    nbytes = _need(entry, "nbytes", _is_int)
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"entry {name!r}: nbytes {nbytes} does not match shape {shape} of {label}")
    if block % dtype.itemsize:
        raise ValueError(
            f"entry {name!r}: the block size {block} ({BLOCK_BYTES_KEY}) is not a multiple of the item size of {label}"
        )
    file = _need(entry, "file", lambda v: isinstance(v, str) and is_data_file_name(v))
    if file in files:
        raise ValueError(f"entry {name!r}: file {file!r} belongs to another entry too")
    files.add(file)
    _need(entry, "data_offset", lambda v: _is_int(v) and 0 < v <= MAX_HEADER_BYTES)
    _need(entry, "header_crc32", _is_crc)
    crcs = _need(entry, BLOCK_CRCS_KEY, lambda v: isinstance(v, list) and len(v) == block_count(nbytes, block))
    if not all(_is_crc(c) for c in crcs):
        raise ValueError(f"entry {name!r}: a block checksum is not a 32-bit unsigned int")
    aggregation = entry.get("aggregation")
    if aggregation not in (_AGGREGATIONS if kind in (MIRRORED, SYNC_ON_READ) else (None,)):
        raise ValueError(f"entry {name!r}: aggregation {aggregation!r} is not one of a {kind} entry's")


def _need(record: dict, key: str, ok: Any) -> Any:
    """``record[key]`` if ``ok`` accepts it; ``KeyError``/``ValueError`` naming the field otherwise."""
    value = record[key]
    if not ok(value):
        where = f"entry {record['name']!r}: " if "kind" in record and isinstance(record.get("name"), str) else ""
        raise ValueError(f"{where}field {key!r} has an unusable value {_short(value)}")
    return value


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_crc(value: Any) -> bool:
    return _is_int(value) and 0 <= value < 1 << 32


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(exc: Exception) -> str:
    return f"missing field {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)


def state_fits(state: Any) -> bool:
    """Whether an iterator state nests shallow enough for a manifest (which adds four levels around it). Local."""
    return json_depth(state) <= MAX_DEPTH - 4
