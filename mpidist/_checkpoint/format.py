"""The checkpoint format on disk and writing it: pure file handling, no MPI, no strategy.

A *checkpoint directory* (the ``path`` given to ``Checkpoint.save``) holds one
subdirectory per kept save, numbered in the order they were made::

    path/
      ckpt-000007/
        manifest.json          names, kinds, shapes, dtypes, aggregation, world size, CRC-32s
        0000-bias.npy          one standard .npy file per array
        0001-weights.npy
      ckpt-000008/ ...         the newest one is "the checkpoint at path"
      .tmp-ckpt-000009-1a2b/   a save in progress (or one that was killed): ignored
      .old-ckpt-000006-3c4d/   an old save being removed (or whose removal was killed): ignored

Every ``.npy`` file is a plain NumPy file (``numpy.load(f, allow_pickle=False)``
reads it); ``manifest.json`` is plain JSON. Nothing in a checkpoint is ever
unpickled or executed. bfloat16 (``ml_dtypes.bfloat16``; NumPy has none) is
spelled ``"bfloat16"`` in the manifest and stored as its 16-bit patterns under
a ``'<u2'`` (uint16) header, so that NumPy alone reads every file; only turning
those bits back into bfloat16 values needs ml_dtypes. The manifest is strict
JSON: an iterator state's NaN and infinities, which JSON cannot spell, are
``null`` there and listed beside the state (:data:`NONFINITE`), so that a
restore puts them back. A save whose iterator states hold NaN or infinities is
of format version 3, one holding bfloat16 of version 2 (at least), any other
of version 1, which every reader since the first reads (as a ``.npy`` header
is of version 1.0 unless it needs 2.0).

Atomicity: a save writes a hidden ``.tmp-ckpt-*`` directory, fsyncs its files
and the directory, and only then renames it to ``ckpt-NNNNNN``: a rename is
atomic, so a save killed at any moment leaves the previous saves untouched,
and readers never see a half-written one. Older saves beyond ``keep`` are
renamed to hidden ``.old-ckpt-*`` names and then deleted, after the commit,
together with leftovers of killed saves and removals. Reading a save (with
every check a reader makes on files it did not write) is in
:mod:`mpidist._checkpoint.reader` and :mod:`mpidist._checkpoint.validate`.

Checksums: CRC-32 (``zlib.crc32``) of every *block* of ``block_bytes`` bytes of
array data, of each ``.npy`` header, and of the manifest itself. CRC-32 is
the fastest checksum in the standard library (about 4 GB/s per core, faster
than any ``hashlib`` digest), detects every burst error up to 32 bits, a
truncation (sizes are recorded too) and random damage with probability
1 - 2^-32 per block; anyone can recompute it with ``zlib.crc32``. It does not
protect against deliberate tampering; nothing in the file is executable, so
tampering can at worst change values.

The arithmetic that splits the work between ranks (:func:`share_ranges`) is
a pure function of sizes and the number of ranks, so it is tested serially.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import secrets
import shutil
import sys
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from mpidist._dtypes import is_bfloat16
from mpidist._errors import CheckpointError
from mpidist._units import human_size
from mpidist._version import __version__

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

__all__ = [
    "BLOCK_BYTES",
    "list_versions",
    "share_ranges",
]

FORMAT = "mpidist-checkpoint"
FORMAT_VERSION = 3  # the newest this mpidist writes and reads
BFLOAT16_VERSION = 2  # the first format whose entries may be bfloat16; saves without bfloat16 stay version 1
NONFINITE_VERSION = 3  # the first whose iterator states may hold NaN and infinities (NONFINITE); others stay older
MANIFEST = "manifest.json"
VERSION_PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-ckpt-"
OLD_PREFIX = ".old-ckpt-"
BLOCK_BYTES = 8 << 20
# The manifest's keys for the block size and the blocks' CRC-32s keep the names format 1 gave them
# on disk ("chunk"), so that every save ever written and every reader stay compatible.
BLOCK_BYTES_KEY, BLOCK_CRCS_KEY = "chunk_bytes", "chunk_crc32"

MIRRORED, SYNC_ON_READ, ARRAY, STATE = "mirrored", "sync_on_read", "array", "state"
# JSON has no NaN or infinities: a state entry holds null in their place, and lists each under this key as
# [path, spelling]: the keys and list indices that lead to it from the entry ("state" or "rank_states" first), and
# its spelling in Python's JSON, which is how it reads back.
NONFINITE = "nonfinite"
NONFINITE_VALUES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
ARRAY_KINDS = (MIRRORED, SYNC_ON_READ, ARRAY)

_VERSION_RE = re.compile(rf"^{re.escape(VERSION_PREFIX)}(\d+)$")
_LEFTOVER_RE = re.compile(rf"^(?:{re.escape(TMP_PREFIX)}|{re.escape(OLD_PREFIX)})(\d+)-")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.npy$")
PathLike = Union[str, "os.PathLike[str]"]
# bfloat16's name in a manifest, and the dtype of its bits in the file (little-endian, as ml_dtypes holds it).
BFLOAT16 = "bfloat16"
BFLOAT16_BITS = np.dtype("<u2")
INSTALL_BFLOAT16 = "pip install 'mpidist[bfloat16]'"
_USER_DTYPES = 256  # NumPy numbers the dtypes of other packages (dtype.num) from here on


# -- dtypes --------------------------------------------------------------------------------
def spell_dtype(dtype: DTypeLike, name: str) -> str:
    """Local: how a manifest spells ``dtype``, if a checkpoint can hold it (else ``TypeError`` naming item ``name``).

    NumPy's bool, integer, floating, complex and datetime dtypes are spelled
    as their ``dtype.str`` (``'<f4'``); ml_dtypes' bfloat16 (or its spelling)
    as :data:`BFLOAT16`. Other packages' dtypes are refused, also those of a
    kind NumPy knows (ml_dtypes' float8 types are of kind ``'f'``): a reader
    could not tell what their spelling means.
    """
    if isinstance(dtype, str) and dtype == BFLOAT16:
        return BFLOAT16
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        _check_byte_order(f"checkpoint item {name!r}")
        return BFLOAT16
    if (
        dtype.kind not in "biufcmM"
        or dtype.num >= _USER_DTYPES
        or dtype.fields is not None
        or dtype.subdtype is not None
    ):
        raise TypeError(
            f"checkpoint item {name!r} has dtype {dtype}, which checkpoints cannot hold; "
            "use a bool, integer, floating, complex, datetime or bfloat16 (ml_dtypes) dtype"
        )
    return dtype.str


def stored_dtype(spelling: str) -> np.dtype:
    """Local: the dtype of the data in an entry's file, as its ``.npy`` header says: the manifest's, or for
    bfloat16 the ``uint16`` of its bits (:data:`BFLOAT16_BITS`). Needs no ml_dtypes."""
    return BFLOAT16_BITS if spelling == BFLOAT16 else np.dtype(spelling)


def dtype_label(spelling: str) -> str:
    """Local: a manifest's dtype as messages and listings name it (``float32``, ``bfloat16``)."""
    return BFLOAT16 if spelling == BFLOAT16 else str(np.dtype(spelling))


def memory_dtype(entry: dict) -> np.dtype:
    """Local: the dtype an entry's data has in memory: ``ml_dtypes.bfloat16`` for a bfloat16 entry (a
    ``TypeError`` naming it when ml_dtypes is not installed), else the manifest's."""
    if entry["dtype"] != BFLOAT16:
        return np.dtype(entry["dtype"])
    _check_byte_order(f"checkpoint entry {entry['name']!r}")
    dtype = bfloat16_dtype()
    if dtype is None:
        raise TypeError(
            f"checkpoint entry {entry['name']!r} is bfloat16, which needs ml_dtypes ({INSTALL_BFLOAT16}); "
            f"without it, numpy.load reads its file {entry['file']} as the uint16 bits"
        )
    return dtype


def bfloat16_dtype() -> Optional[np.dtype]:
    """Local: ml_dtypes' bfloat16, or ``None`` when ml_dtypes (an optional dependency) is not installed."""
    try:
        import ml_dtypes  # imported only for a bfloat16 entry
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _check_byte_order(what: str) -> None:
    """``TypeError`` on a big-endian machine, whose bfloat16 bits in memory are not the little-endian file's."""
    if sys.byteorder != "little":
        raise TypeError(
            f"{what} is bfloat16, which checkpoints store as little-endian bits; this machine is big-endian"
        )


# -- arrays and headers ----------------------------------------------------------------
def npy_header(shape: Sequence[int], dtype: np.dtype) -> bytes:
    """The ``.npy`` header (format 1.0, or 2.0 when needed) of a C-ordered array; its length is a multiple of 64."""
    header = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": tuple(int(s) for s in shape),
    }
    out = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(out, header)
    except ValueError:  # too many dimensions for a 1.0 header
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, header)
    return out.getvalue()


def safe_file_name(index: int, name: str) -> str:
    """``0003-layer1.kernel.npy``: the entry's index keeps names unique, the rest keeps them readable."""
    return f"{index:04d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:80]}.npy"


def is_version_name(name: str) -> bool:
    """Whether ``name`` is the name of a save inside a checkpoint directory (``ckpt-NNNNNN``)."""
    return _VERSION_RE.match(name) is not None


def is_data_file_name(name: str) -> bool:
    """Whether ``name`` is a plain ``.npy`` file name inside a save (no path separators, not hidden)."""
    return _FILE_RE.match(name) is not None


def block_count(nbytes: int, block_bytes: int) -> int:
    """How many checksummed blocks ``nbytes`` of data make (the last one may be shorter)."""
    return -(-nbytes // block_bytes)


def share_ranges(
    sizes: Sequence[int], nranks: int, block_bytes: int, rank0_only: Optional[Sequence[bool]] = None
) -> list[list[tuple[int, int]]]:
    """Split the bytes of several arrays between ``nranks`` ranks, in whole blocks.

    Returns ``ranges[e][r] = (lo, hi)``: the bytes of entry ``e`` that rank
    ``r`` handles. Within an entry the ranks' ranges are contiguous, in rank
    order, and together cover the entry; boundaries fall on multiples of
    ``block_bytes``. The blocks of all entries (except those in
    ``rank0_only``, which rank 0 handles alone) are dealt out as one stream,
    each rank getting an equal share of the bytes, so many small arrays are
    spread over the ranks as well as one large one.
    """
    if nranks < 1 or block_bytes < 1:
        raise ValueError(f"share_ranges needs nranks >= 1 and block_bytes >= 1, got {nranks}, {block_bytes}")
    fixed = list(rank0_only) if rank0_only is not None else [False] * len(sizes)
    total = sum(int(s) for s, f in zip(sizes, fixed) if not f)
    result: list[list[tuple[int, int]]] = []
    pos = 0
    for size, alone in zip(sizes, fixed):
        size = int(size)
        if alone:
            result.append([(0, size)] + [(size, size)] * (nranks - 1))
            continue
        # bounds[r]: where rank r's range starts. A block goes to the rank owning its midpoint
        # in the stream; owners never decrease along the stream, so each rank's blocks are contiguous.
        bounds = [size] * (nranks + 1)
        next_rank = 0
        for lo in range(0, size, block_bytes):
            hi = min(lo + block_bytes, size)
            owner = min(nranks - 1, (2 * (pos + lo) + (hi - lo)) * nranks // (2 * total))
            while next_rank <= owner:
                bounds[next_rank] = lo
                next_rank += 1
        result.append([(bounds[r], bounds[r + 1]) for r in range(nranks)])
        pos += size
    return result


# -- moving bytes ------------------------------------------------------------------------
def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_block(fd: int, data: memoryview, offset: int) -> int:
    """Write ``data`` at ``offset``; returns its CRC-32."""
    _pwrite_all(fd, data, offset)
    return zlib.crc32(data)


def pread_into(fd: int, out: memoryview, offset: int) -> int:
    """Fill ``out`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def run_tasks(tasks: Sequence[Callable[..., Any]], threads: int) -> list[Any]:
    """Run ``tasks`` (file I/O and CRCs, which release the GIL) on up to ``threads`` threads."""
    if threads <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(max_workers=min(threads, len(tasks))) as pool:
        return list(pool.map(lambda task: task(), tasks))


@dataclasses.dataclass
class Piece:
    """Bytes ``[lo, hi)`` of one entry's data: what one rank writes or reads of it."""

    entry: dict
    lo: int
    hi: int
    buffer: Any = None  # uint8 array of hi - lo bytes (data to write, or where reads land; made by the reader if None)


def write_pieces(
    directory: Path, pieces: list[Piece], block_bytes: int, threads: int, fsync: bool
) -> dict[str, dict[int, int]]:
    """Write each piece's buffer into its entry's (pre-sized) file; return ``{name: {block: crc32}}``.

    The files must exist (see :func:`create_files`). Files are fsynced before
    returning when ``fsync``. Local.
    """
    fds: dict[str, int] = {}
    tasks = []
    try:
        for piece in pieces:
            entry = piece.entry
            if entry["file"] not in fds:
                fds[entry["file"]] = os.open(directory / entry["file"], os.O_WRONLY)
            fd = fds[entry["file"]]
            view = memoryview(piece.buffer)
            for lo in range(piece.lo, piece.hi, block_bytes):
                part = view[lo - piece.lo : min(lo + block_bytes, piece.hi) - piece.lo]
                tasks.append(
                    lambda fd=fd, part=part, lo=lo, entry=entry: (
                        entry["name"],
                        lo // block_bytes,
                        _write_block(fd, part, entry["data_offset"] + lo),
                    )
                )
        crcs: dict[str, dict[int, int]] = {}
        for name, index, crc in run_tasks(tasks, threads):
            crcs.setdefault(name, {})[index] = crc
        if fsync:
            run_tasks([lambda fd=fd: os.fsync(fd) for fd in fds.values()], threads)
    finally:
        for fd in fds.values():
            os.close(fd)
    return crcs


# -- manifest ----------------------------------------------------------------------------
def canonical(obj: Any) -> bytes:
    """The form of a manifest that its CRC-32 covers: JSON with sorted keys and no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(manifest: dict) -> bytes:
    """The manifest as strict JSON text (``ValueError`` on a NaN or infinity) with its own CRC-32 (of the
    canonical form of everything else)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return json.dumps({**body, "manifest_crc32": zlib.crc32(canonical(body))}, indent=1, allow_nan=False).encode()


def make_manifest(entries: list[dict], world_size: int, block_bytes: int) -> dict:
    """The manifest of a save: of format version 1 unless an entry needs a newer one (bfloat16 needs 2, a state
    with NaN or infinities 3)."""
    return {
        "format": FORMAT,
        "format_version": max(
            BFLOAT16_VERSION if any(e.get("dtype") == BFLOAT16 for e in entries) else 1,
            NONFINITE_VERSION if any(NONFINITE in e for e in entries) else 1,
        ),
        "mpidist_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world_size": world_size,
        "checksum": "crc32",
        BLOCK_BYTES_KEY: block_bytes,
        "entries": entries,
    }


def strict_state(state: Any) -> tuple[Any, list[list]]:
    """Local: a copy of the JSON value ``state`` with each NaN or infinity replaced by ``None``, and where each was:
    ``[path, spelling]`` (the path from ``state``, see :data:`NONFINITE`)."""
    marks: list[list] = []
    path: list[Union[str, int]] = []

    def copy(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            marks.append([list(path), json.dumps(value)])  # "NaN", "Infinity" or "-Infinity"
            return None
        if isinstance(value, dict):
            return {key: inside(key, item) for key, item in value.items()}
        if isinstance(value, list):
            return [inside(index, item) for index, item in enumerate(value)]
        return value

    def inside(step: Union[str, int], item: Any) -> Any:
        path.append(step)
        result = copy(item)
        path.pop()
        return result

    return copy(state), marks


def saved_state(entry: dict, rank: int) -> Any:
    """Local: a fresh copy of the state a state entry (checked: :mod:`mpidist._checkpoint.validate`) holds for
    ``rank``, with its NaN and infinities (:data:`NONFINITE`) in place of their nulls."""
    at: list[Union[str, int]] = ["state"] if "state" in entry else ["rank_states", rank]
    state = json.loads(json.dumps(entry["state"] if "state" in entry else entry["rank_states"][rank]))
    for path, spelling in entry.get(NONFINITE, ()):
        if path[: len(at)] != at:
            continue  # another rank's
        if len(path) == len(at):
            return NONFINITE_VALUES[spelling]  # the state itself
        holder = state
        for step in path[len(at) : -1]:
            holder = holder[step]
        holder[path[-1]] = NONFINITE_VALUES[spelling]
    return state


def entry_array(entry: dict, buffer: ArrayLike, dtype: np.dtype) -> np.ndarray:
    """The entry's bytes (a ``uint8`` array) viewed with its shape and ``dtype`` (its :func:`memory_dtype`)."""
    return np.asarray(buffer).view(dtype).reshape(entry["shape"])


# -- directories -------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_versions(path: PathLike) -> list[Path]:
    """The saves in checkpoint directory ``path``, oldest first: every ``ckpt-NNNNNN`` in it. Local.

    A save appears here only through the rename that commits it (with its
    manifest) and leaves only through the rename that starts its removal, so
    a listed save is complete unless it was damaged since: one without its
    manifest is listed too, and reading it raises, instead of going back to
    an older save unnoticed.
    """
    root = Path(path)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        if is_version_name(child.name):
            found.append((int(child.name[len(VERSION_PREFIX) :]), child))
    return [p for _, p in sorted(found)]


def begin_save(path: PathLike) -> tuple[Path, int]:
    """Create the temporary directory of the next save in ``path``; returns it and the save's number. Local."""
    root = Path(path)
    if (root / MANIFEST).is_file():
        raise CheckpointError(
            f"{root} is one save inside a checkpoint directory; save into the checkpoint "
            f"directory itself ({root.parent})"
        )
    root.mkdir(parents=True, exist_ok=True)
    numbers = [0]
    for child in root.iterdir():
        match = _VERSION_RE.match(child.name) or _LEFTOVER_RE.match(child.name)
        if match:
            numbers.append(int(match.group(1)))
        elif not child.name.startswith("."):
            raise CheckpointError(
                f"{root} exists and holds {child.name!r}, which is not part of an mpidist "
                "checkpoint; save into an empty or new directory (a checkpoint directory "
                f"holds only {VERSION_PREFIX}NNNNNN subdirectories)"
            )
    number = max(numbers) + 1
    tmp = root / f"{TMP_PREFIX}{number:06d}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp, number


def create_files(directory: Path, entries: list[dict]) -> None:
    """Create each entry's ``.npy`` file with its header, sized for its data. Local."""
    for entry in entries:
        header = npy_header(entry["shape"], stored_dtype(entry["dtype"]))
        fd = os.open(directory / entry["file"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _pwrite_all(fd, memoryview(header), 0)
            os.ftruncate(fd, len(header) + entry["nbytes"])
        finally:
            os.close(fd)


def commit(tmp: Path, number: int, manifest: bytes, fsync: bool) -> Path:
    """Write the (encoded) manifest, then rename ``tmp`` to ``ckpt-NNNNNN``: the atomic step of a save. Local."""
    fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite_all(fd, memoryview(manifest), 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if fsync:
        fsync_dir(tmp)
    final = tmp.parent / f"{VERSION_PREFIX}{number:06d}"
    os.rename(tmp, final)
    if fsync:
        fsync_dir(tmp.parent)
    return final


def prune(root: Path, keep: int, current: Path) -> list[str]:
    """Remove saves older than the newest ``keep``, and leftovers of killed saves and removals; returns problems. Local.

    Each old save is first renamed to a hidden ``.old-ckpt-*`` name, which
    takes it out of the listing in one atomic step, and only then deleted:
    a removal killed at any moment leaves no half-deleted save listed, only
    a hidden leftover that the next call removes.
    """
    problems = []
    for path in [p for p in list_versions(root)[:-keep] if p != current]:
        number = path.name[len(VERSION_PREFIX) :]
        try:
            os.rename(path, root / f"{OLD_PREFIX}{number}-{secrets.token_hex(4)}")
        except OSError as exc:
            problems.append(f"could not remove {path}: {exc}")
    for child in root.iterdir():
        if _LEFTOVER_RE.match(child.name):
            try:
                _remove(child)
            except OSError as exc:
                problems.append(f"could not remove {child}: {exc}")
    return problems


def _remove(path: Path) -> None:
    """Delete a file, a symbolic link (not what it points to) or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def discard(tmp: Path) -> None:
    """Remove the temporary directory of a failed save (best effort). Local."""
    shutil.rmtree(tmp, ignore_errors=True)


# -- threads and listings ------------------------------------------------------------------------
def io_threads(ranks_on_node: int = 1) -> int:
    """Threads for file I/O and CRCs: this node's cores shared among its ranks, 1 to 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // max(1, ranks_on_node)))


def describe_entry(entry: dict) -> dict[str, str]:
    """Columns of one entry for listings: name, kind, shape, dtype, aggregation, size."""
    if entry["kind"] == STATE:
        states = entry.get("rank_states")
        detail = f"{len(states)} per-rank states" if states is not None else json.dumps(saved_state(entry, 0))
        return {
            "name": entry["name"],
            "kind": STATE,
            "shape": "",
            "dtype": "",
            "aggregation": "",
            "size": detail if len(detail) <= 40 else detail[:37] + "...",
        }
    return {
        "name": entry["name"],
        "kind": entry["kind"],
        "shape": str(tuple(entry["shape"])),
        "dtype": dtype_label(entry["dtype"]),
        "aggregation": entry.get("aggregation") or "",
        "size": human_size(entry["nbytes"]),
    }
