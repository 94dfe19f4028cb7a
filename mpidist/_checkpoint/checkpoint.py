"""Checkpoints of distributed variables, plain arrays and input positions.

``Checkpoint(**items)`` names what to save; :meth:`Checkpoint.save` and
:meth:`Checkpoint.restore` are collective over the variables' strategy. The
saving rules of TF's ``_MirroredSaveable`` / ``_TowerLocalSaveable``, which
each variable's synchronization policy owns (the checkpoint asks the policy
what to save and how to restore it, see :mod:`mpidist._distribute.variables`):

- a mirrored variable saves its value once and restores it to every rank;
- a sync-on-read variable saves its reduced value (what ``read_value()``
  gives in cross-replica context) and restores through cross-replica
  ``assign``: ``SUM`` values are split over the ranks present at restore
  (exactly, for integers), other aggregations are set on every rank;
- a plain NumPy array is saved from rank 0 and restored in place on every rank;
- an iterator-like object (``get_state() -> dict``, ``set_state(dict)``)
  saves its JSON state, so training resumes at the same input position.

A checkpoint saved by N ranks restores on any number of ranks. The file
format, atomic commit and checksums live in :mod:`mpidist._checkpoint.format`,
reading and checking a save in :mod:`mpidist._checkpoint.reader` (both
usable without MPI); this module adds the collective protocol:

1. Ranks agree on what is saved (names, kinds, shapes, dtypes, options); a
   difference raises ``ValueError`` on every rank before anything is written.
   With ``check_mirrors`` they also compare a CRC-32 of each mirrored
   variable's component, and a difference raises ``MirrorDivergenceError``
   on every rank; without it, rank 0's components are broadcast, so a
   mirrored variable is always saved as rank 0's value, never as a mix.
2. Rank 0 creates a hidden temporary directory with every ``.npy`` file
   pre-sized; the directory must be on a file system all ranks share.
3. Every rank writes its share of the bytes (whole blocks, balanced over the
   ranks) with ``os.pwrite``, computes their CRC-32s and fsyncs.
4. Ranks agree that all writes succeeded; rank 0 writes the manifest and
   renames the directory into place (the commit), then prunes old saves.

Restore reads and checks the manifest and the data files' types and sizes on
rank 0, checks every item against it on every rank, lets each rank read and
verify only its share of the blocks, agrees that all of that succeeded, and
only then modifies anything. The shares are split among the ranks of each
node, so every byte is read from the file system once per node, and
exchanged within the node (one broadcast from the rank that read an array, or one
allgather when several ranks share it) (no byte crosses the
network); a host array or mirrored component receives the allgather
directly, with no further copy. A failure on any rank
raises the same exception type on every rank (never a hang) and leaves
every variable, array and iterator as it was.

Each step of a save or restore ends with the ranks agreeing whether all of
them succeeded (an interrupt inside a step is reported too), and its
collectives carry the step's name (``Checkpoint.save 3/4: write``), which the
ranks compare before every collective: a rank that left a save or restore
midway and starts another meets the others in a different step, and every
rank raises ``CollectiveMismatchError`` naming both steps.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from mpidist._checkpoint import format as fmt, validate
from mpidist._checkpoint.reader import Save, read_checkpoint
from mpidist._comm.backend import host_bytes
from mpidist._comm.communicator import Communicator, describe_failures
from mpidist._distribute.context import get_replica_context, get_strategy
from mpidist._distribute.mirrors import describe, diverged
from mpidist._distribute.variables import DistributedVariable, VariableSynchronization
from mpidist._errors import CheckpointError, ChecksumError, MirrorDivergenceError, on_rank

if TYPE_CHECKING:
    from mpidist._distribute.strategy import MPIStrategy

__all__ = ["Checkpoint", "read_checkpoint"]

# Exception types a failing rank can make every rank raise (by name: nothing is unpickled).
_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (ChecksumError, CheckpointError, FileNotFoundError, TypeError, ValueError, RuntimeError)
}
# Arrays larger than this are exchanged in rounds of one block per rank (MPI counts are 32-bit).
_MAX_GATHER_BYTES = 1 << 30
# The kind a variable is saved as, by its synchronization (the manifest's words).
_VARIABLE_KINDS = {VariableSynchronization.ON_WRITE: fmt.MIRRORED, VariableSynchronization.ON_READ: fmt.SYNC_ON_READ}


def _kind(name: str, obj: Any) -> str:
    if isinstance(obj, DistributedVariable):
        return _VARIABLE_KINDS[obj.synchronization]
    if isinstance(obj, np.ndarray):
        return fmt.ARRAY
    if callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None)):
        return fmt.STATE
    raise TypeError(
        f"Checkpoint item {name!r} is a {type(obj).__name__}; a checkpoint holds mpidist variables, "
        "NumPy arrays (use a 0-d array for a counter) and objects with get_state() and set_state()"
    )


def _shown(path: Any) -> str:
    """``path`` for messages, also when it is no path (the step that uses it makes every rank raise). Local."""
    try:
        return os.fsdecode(path)
    except TypeError:
        return repr(path)


def _error_record(exc: BaseException) -> dict:
    """What the other ranks need to raise the exception a failed rank raises: its type (the nearest of
    :data:`_ERRORS`), and the file and entry of a :class:`ChecksumError`."""
    kind = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS), CheckpointError.__name__)
    return {"type": kind, "file": getattr(exc, "file", None), "entry": getattr(exc, "entry", None)}


def _steps(operation: str, *steps: str) -> tuple[str, ...]:
    """The names of an operation's steps, e.g. ``"Checkpoint.save 3/4: write"``. Local."""
    return tuple(f"Checkpoint.{operation} {i}/{len(steps)}: {step}" for i, step in enumerate(steps, 1))


# The steps of a save and of a restore; each step's collectives carry its name (see the module docstring).
_AGREE, _PREPARE, _WRITE, _COMMIT = _steps("save", "items and arguments", "temporary directory", "write", "commit")
_MANIFEST, _ITEMS, _READ, _STATES = _steps("restore", "manifest", "items", "read", "iterator states")


class _Protocol:
    """The collective steps of one save or restore; each step asks whether every rank succeeded.

    The question is the communicator's :meth:`~mpidist.Communicator.outcome`:
    when some rank failed, every rank raises the exception type of the lowest
    failed rank, with a message naming every failed rank and what failed there.
    A step's local work catches every exception, also ``KeyboardInterrupt`` and
    ``SystemExit``, so that a rank leaves a save or restore only together with
    the others: such an interrupt is re-raised on its own rank once every rank
    knows of it (the others raise ``CheckpointError`` naming it).
    """

    def __init__(self, strategy: MPIStrategy, what: str) -> None:
        self.comm = strategy.communicator
        self.rank, self.size = strategy.rank, strategy.num_replicas_in_sync
        self.what = what

    def check(self, failure: Optional[BaseException], step: str) -> None:
        """Collective: return when no rank failed in ``step`` (``failure`` is this rank's error); else raise on
        every rank."""
        failures = self.comm.outcome(failure, step)
        if not failures:
            return
        first = min(failures)  # the same on every rank: it tells the others its exception type
        mine = json.dumps(_error_record(failure)).encode() if self.rank == first and failure is not None else None
        record = json.loads(self.comm.broadcast_bytes(mine, first, name=f"{step} (error)"))
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # an interrupt stays what it is on its own rank
        cls = _ERRORS[record["type"]]
        message = on_rank(self.rank, f"{self.what}: {describe_failures(failures)}")
        exc = cls(message, file=record["file"], entry=record["entry"]) if cls is ChecksumError else cls(message)
        raise exc from failure

    def gather(self, payload: Any, failure: Optional[BaseException], step: str) -> list[Any]:
        """Collective: every rank's JSON ``payload``; if any rank failed, raise on every rank."""
        self.check(failure, step)
        return [json.loads(b) for b in self.comm.allgather_bytes(json.dumps(payload).encode(), name=step)]

    def share(self, payload: Any, failure: Optional[BaseException], step: str) -> Any:
        """Collective: rank 0's JSON ``payload`` on every rank; if any rank failed, raise on every rank."""
        self.check(failure, step)
        data = json.dumps(payload).encode() if self.rank == 0 else None
        return json.loads(self.comm.broadcast_bytes(data, 0, name=step))

    def same(self, descriptions: list[Any], what: str) -> None:
        """Raise ``ValueError`` (on every rank: all see the same list) unless all ranks described the same."""
        differ = [r for r, d in enumerate(descriptions) if d != descriptions[0]]
        if differ:
            raise ValueError(
                f"{on_rank(self.rank, self.what)}: ranks disagree on {what}: {on_rank(0, str(descriptions[0]))}; "
                f"{on_rank(differ[0], str(descriptions[differ[0]]))}. Every rank must call it with "
                "the same items (names, kinds, shapes, dtypes) and options"
            )


class Checkpoint:
    """Named variables, arrays and iterator positions, saved and restored together.

    Args:
        **items: name -> item. An item is a ``MirroredVariable``, a
            ``SyncOnReadVariable`` (all of one strategy), a NumPy array, or an
            object with ``get_state() -> dict`` (JSON-serialisable) and
            ``set_state(dict)``, such as an input iterator.

    Construction is local. :meth:`save` and :meth:`restore` are collective
    over the variables' strategy (the strategy whose ``scope()`` is active,
    when the checkpoint holds no variables): every rank calls them with the
    same items and path. The directory must be on a file system every rank
    sees (any parallel or network file system; a node-local disk works only
    on one node). See :mod:`mpidist._checkpoint.format` for the layout on disk.
    """

    def __init__(self, **items: Any) -> None:
        if not items:
            raise ValueError("Checkpoint() needs at least one item, e.g. Checkpoint(weights=w, step=step)")
        self._items = {name: (_kind(name, obj), obj) for name, obj in sorted(items.items())}
        strategies = {
            id(obj.strategy): obj.strategy for _, obj in self._items.values() if isinstance(obj, DistributedVariable)
        }
        if len(strategies) > 1:
            raise ValueError(
                "Checkpoint items belong to different strategies; a checkpoint saves the variables "
                "of one strategy: make one Checkpoint per strategy"
            )
        self._strategy = next(iter(strategies.values()), None)
        self._share_buffer: Optional[np.ndarray] = None  # what this rank's last restore read into, reused

    @property
    def items(self) -> Mapping[str, Any]:
        """The items, by name (a copy). Local."""
        return {name: obj for name, (_, obj) in self._items.items()}

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(f'{n}=<{k}>' for n, (k, _) in self._items.items())})"

    # -- save ----------------------------------------------------------------------------
    def save(
        self,
        path: fmt.PathLike,
        *,
        keep: int = 1,
        fsync: bool = True,
        block_bytes: int = fmt.BLOCK_BYTES,
        check_mirrors: bool = True,
        chunk_bytes: Optional[int] = None,
    ) -> str:
        """Collective: write a new save into checkpoint directory ``path``; returns its directory.

        The save becomes visible in one atomic rename after every byte is
        written, checksummed and (with ``fsync``) on stable storage; a save
        that fails or is killed at any moment leaves the saves already at
        ``path`` untouched. Large arrays are written by all ranks in parallel.

        Args:
            path: the checkpoint directory (created if missing). Each save
                goes into a new subdirectory ``ckpt-NNNNNN``.
            keep: how many saves to keep, newest first; older ones are
                removed after the new one is committed (each renamed to a
                hidden name first, so a removal killed midway leaves no
                half-deleted save listed).
            fsync: flush data, manifest and directories to stable storage
                before the commit (survives a power loss, not only a crash).
                Turn off only for scratch checkpoints.
            block_bytes: size of the blocks of data that are checksummed
                and dealt out to the ranks (default 8 MiB; a multiple of 32, ideally of the file
                system's stripe size).
            check_mirrors: compare a CRC-32 of every mirrored variable's
                component between ranks before writing anything, and raise
                if they differ. It costs one pass over every mirrored
                variable's bytes on every rank (a device-to-host copy on a
                GPU) and no extra message. Without it, rank 0's components
                are broadcast to the other ranks (which write their share of
                them), so a mirrored variable is saved as rank 0's value
                also when its components diverged.
            chunk_bytes: the former name of ``block_bytes``, still accepted.

        Raises:
            ValueError: ranks disagree on items or arguments, or bad arguments.
            TypeError: an item's dtype cannot be saved (object, structured, ml_dtypes' float8, int4, ...).
            MirrorDivergenceError: with ``check_mirrors``, the components of
                a mirrored variable differ between ranks (nothing is written;
                all ranks raise it, naming the variables and ranks).
            CheckpointError: writing failed on some rank (all ranks raise it).
        """
        strategy = self._strategy_for("save")
        run = _Protocol(strategy, f"Checkpoint.save to {_shown(path)} failed, the saves already there are intact")
        check = bool(check_mirrors) and run.size > 1  # one replica has no other components to compare
        entries, block_bytes = self._agree_on_entries(run, path, keep, fsync, block_bytes, chunk_bytes, check)
        values = self._values(first_replica=not check)
        arrays = [e for e in entries if e["kind"] in fmt.ARRAY_KINDS]
        tmp, number = self._prepare(run, path, arrays)
        try:
            crcs = self._write_shares(run, tmp, arrays, values, block_bytes, fsync)
            # rank 0 commits: manifest, rename, prune
            failure: Optional[BaseException] = None
            payload: dict = {}
            if run.rank == 0:
                try:
                    for entry in arrays:
                        entry[fmt.BLOCK_CRCS_KEY] = [
                            crcs[entry["name"]][i] for i in range(fmt.block_count(entry["nbytes"], block_bytes))
                        ]
                    manifest = fmt.encode_manifest(fmt.make_manifest(entries, run.size, block_bytes))
                    validate.decode_manifest(manifest, str(tmp / fmt.MANIFEST))  # never write what a reader refuses
                    final = fmt.commit(tmp, number, manifest, fsync)
                    payload = {"path": str(final), "problems": fmt.prune(Path(path), keep, final)}
                except BaseException as exc:  # every rank must hear of it, also of an interrupt
                    failure = exc
            reply = run.share(payload, failure, _COMMIT)
        except BaseException:  # failed on some rank, or left midway on this one: no temporary directory stays
            if run.rank == 0:
                fmt.discard(tmp)  # nothing to do once the commit renamed it
            raise
        if reply["problems"] and run.rank == 0:
            warnings.warn(
                f"Checkpoint.save committed {reply['path']} but could not prune older saves: "
                + "; ".join(reply["problems"]),
                RuntimeWarning,
                stacklevel=2,
            )
        return reply["path"]

    def _agree_on_entries(
        self,
        run: _Protocol,
        path: fmt.PathLike,
        keep: Any,
        fsync: bool,
        block_bytes: Any,
        chunk_bytes: Any,
        check_mirrors: bool,
    ) -> tuple[list[dict], int]:
        """Collective: check save's arguments, and that all ranks save the same items with the same arguments
        (and, with ``check_mirrors``, the same mirrored values); the manifest entries and the block size.

        An invalid argument on some ranks only makes every rank raise: the checks run inside this step.
        """
        failure: Optional[BaseException] = None
        args: list = []
        descriptions: list[dict] = []
        states: dict[str, Any] = {}
        mirrors: dict[str, int] = {}
        try:
            if not isinstance(keep, int) or keep < 1:
                raise ValueError(f"Checkpoint.save: keep must be a positive int (how many saves to keep), got {keep!r}")
            block_bytes = _block_size(block_bytes, chunk_bytes)
            args = [os.fsdecode(path), keep, fsync, block_bytes, check_mirrors]
            descriptions = self._describe()
            states = {
                name: self._get_state(name, obj) for name, (kind, obj) in self._items.items() if kind == fmt.STATE
            }
            if check_mirrors:
                threads = fmt.io_threads(run.comm.local_size)
                mirrors = {
                    name: fingerprint
                    for name, obj in self._variables()
                    if (fingerprint := obj.policy.mirror_fingerprint(obj, threads)) is not None
                }
        except BaseException as exc:  # reported to every rank by the agreement
            failure = exc
        replies = run.gather(
            {"items": descriptions, "args": args, "states": states, "mirrors": mirrors}, failure, _AGREE
        )
        run.same([r["items"] for r in replies], "the checkpoint's items")
        run.same([r["args"] for r in replies], "the arguments of save (path, keep, fsync, block_bytes, check_mirrors)")
        _check_mirrors(run.rank, run.what, [r["mirrors"] for r in replies])
        return self._entries(descriptions, [r["states"] for r in replies]), block_bytes

    @staticmethod
    def _prepare(run: _Protocol, path: fmt.PathLike, arrays: list[dict]) -> tuple[Path, int]:
        """Collective: rank 0 creates the temporary directory with every file pre-sized."""
        failure: Optional[BaseException] = None
        payload: dict = {}
        if run.rank == 0:
            try:
                tmp, number = fmt.begin_save(path)
                payload = {"tmp": str(tmp), "number": number}
                fmt.create_files(tmp, arrays)
            except BaseException as exc:
                failure = exc
        try:
            reply = run.share(payload, failure, _PREPARE)
        except BaseException:  # failed here, or on another rank: rank 0 removes what it created
            if payload:
                fmt.discard(Path(payload["tmp"]))
            raise
        return Path(reply["tmp"]), reply["number"]

    def _write_shares(
        self, run: _Protocol, tmp: Path, arrays: list[dict], values: dict[str, Any], block_bytes: int, fsync: bool
    ) -> dict[str, dict[int, int]]:
        """Collective: every rank writes and checksums its share; all blocks' CRC-32s, by entry."""
        failure: Optional[BaseException] = None
        crcs: dict[str, dict[int, int]] = {}
        ranges = fmt.share_ranges(
            [e["nbytes"] for e in arrays], run.size, block_bytes, rank0_only=[e["kind"] == fmt.ARRAY for e in arrays]
        )
        try:
            self._check_visible(tmp)
            pieces = [
                fmt.Piece(e, lo, hi, host_bytes(values[e["name"]], lo, hi))
                for e, shares in zip(arrays, ranges)
                for lo, hi in [shares[run.rank]]
                if hi > lo
            ]
            crcs = fmt.write_pieces(tmp, pieces, block_bytes, fmt.io_threads(run.comm.local_size), fsync)
        except BaseException as exc:
            failure = exc
        replies = run.gather({name: {str(k): v for k, v in c.items()} for name, c in crcs.items()}, failure, _WRITE)
        merged: dict[str, dict[int, int]] = {e["name"]: {} for e in arrays}
        for reply in replies:
            for name, blocks in reply.items():
                merged[name].update((int(k), v) for k, v in blocks.items())
        return merged

    # -- restore -------------------------------------------------------------------------
    def restore(self, path: fmt.PathLike) -> str:
        """Collective: restore every item from a save; returns the save's directory.

        ``path`` is a checkpoint directory (its newest save is used) or one
        save inside it (``path/ckpt-000003``). The save may come from any
        number of ranks. All-or-nothing: items are checked against the
        manifest and every rank's share of the data is read and verified
        before anything is modified; on any failure every rank raises and
        nothing changed. Entries of the checkpoint without an item here are
        ignored.

        Each rank reads its share into a host buffer (the restored bytes
        divided by the ranks on its node) that this Checkpoint keeps for its
        next restore, so restoring again (a rollback) allocates no new memory;
        drop the Checkpoint to release it.

        Raises:
            FileNotFoundError: no complete save at ``path``.
            ValueError: an item is missing from the checkpoint, or its shape,
                dtype or kind differs (the message names it and both values).
            ChecksumError: a file is damaged (named in the message).
            CheckpointError: reading failed on some rank.
        """
        strategy = self._strategy_for("restore")
        run = _Protocol(strategy, f"Checkpoint.restore from {_shown(path)} failed, nothing was modified")
        directory, manifest = self._load_manifest(run, path)
        failure: Optional[BaseException] = None
        plan: list[tuple[str, str, Any, dict]] = []
        descriptions: list[dict] = []
        where = ""
        try:
            where = os.fsdecode(path)  # rank 0 alone found the save: every rank must have asked for it
            descriptions = self._describe()
            plan = self._match(manifest, directory, run.size)
        except BaseException as exc:
            failure = exc
        replies = run.gather({"items": descriptions, "path": where}, failure, _ITEMS)
        run.same([r["items"] for r in replies], "the checkpoint's items")
        run.same([r["path"] for r in replies], "the path of restore")
        arrays = [(obj, entry) for _, kind, obj, entry in plan if kind != fmt.STATE]
        block_bytes = manifest[fmt.BLOCK_BYTES_KEY]
        node = run.comm.node()  # the ranks that share this node's memory: each byte is read once per node
        ranges = fmt.share_ranges([entry["nbytes"] for *_, entry in arrays], node.size, block_bytes)
        shares = self._read_shares(run, node.rank, directory, manifest, [entry for *_, entry in arrays], ranges)
        self._set_states(run, [(name, obj, entry) for name, kind, obj, entry in plan if kind == fmt.STATE])
        # nothing can fail any more: exchange the shares within each node and assign
        for (obj, entry), entry_ranges, share in zip(arrays, ranges, shares):
            target = _direct_target(obj)
            data = self._assemble(node, entry, entry_ranges, share, block_bytes, target)
            if target is not None:
                continue  # the allgather wrote the value in place
            value = fmt.entry_array(entry, data, obj.dtype)
            if isinstance(obj, DistributedVariable):
                obj.policy.restore(obj, value)
            else:
                obj[...] = value
        return str(directory)

    @staticmethod
    def _load_manifest(run: _Protocol, path: fmt.PathLike) -> tuple[Path, dict]:
        """Collective: rank 0 finds the save, checks its manifest and files; every rank gets both."""
        failure: Optional[BaseException] = None
        payload: dict = {}
        if run.rank == 0:
            try:
                with Save.open(path) as save:
                    save.check(save.arrays)
                    payload = {"dir": str(save.directory), "manifest": save.manifest}
            except BaseException as exc:  # MemoryError, OSError, an interrupt too: every rank must hear of it
                failure = exc
        reply = run.share(payload, failure, _MANIFEST)
        return Path(reply["dir"]), reply["manifest"]

    def _read_shares(
        self,
        run: _Protocol,
        share: int,
        directory: Path,
        manifest: dict,
        entries: list[dict],
        ranges: list[list[tuple[int, int]]],
    ) -> list[np.ndarray]:
        """Collective: every rank reads and verifies share ``share`` of every entry; raises everywhere on failure."""
        failure: Optional[BaseException] = None
        pieces = [
            fmt.Piece(entry, lo, hi) for entry, entry_ranges in zip(entries, ranges) for lo, hi in [entry_ranges[share]]
        ]
        try:
            self._check_visible(directory)
            self._place(pieces)
            with Save.at(directory, manifest) as save:
                save.read([p for p in pieces if p.hi > p.lo], fmt.io_threads(run.comm.local_size))
        except BaseException as exc:
            failure = exc
        run.check(failure, _READ)
        return [p.buffer for p in pieces]

    def _place(self, pieces: list[fmt.Piece]) -> None:
        """Give each piece its consecutive part of this rank's share buffer, which later restores reuse. Local.

        Reading into memory that an earlier restore already touched costs no
        page faults, a large part of the cost of reading into new memory. The
        buffer grows when a restore needs more; it lives as long as this
        Checkpoint.
        """
        total = sum(p.hi - p.lo for p in pieces)
        if self._share_buffer is None or self._share_buffer.size < total:
            self._share_buffer = None  # let the smaller one go before the larger one is allocated
            self._share_buffer = np.empty(total, np.uint8)
        offset = 0
        for piece in pieces:
            piece.buffer = self._share_buffer[offset : offset + piece.hi - piece.lo]
            offset += piece.hi - piece.lo

    def _set_states(self, run: _Protocol, states: list[tuple[str, Any, dict]]) -> None:
        """Collective: ``set_state`` of each iterator; rolled back on every rank unless all ranks succeeded."""
        failure: Optional[BaseException] = None
        previous: dict[str, Any] = {}
        try:
            for name, obj, entry in states:
                state = fmt.saved_state(entry, run.rank)  # a fresh copy
                previous[name] = obj.get_state()
                obj.set_state(state)
        except BaseException as exc:
            failure = exc
        try:
            run.check(failure, _STATES)
        except BaseException:
            self._roll_back(previous)
            raise

    # -- helpers -----------------------------------------------------------------------------
    def _strategy_for(self, what: str) -> MPIStrategy:
        if get_replica_context() is not None:
            raise RuntimeError(
                f"Checkpoint.{what} is a collective, cross-replica call; call it outside "
                "strategy.run (inside merge_call or scope() is fine)"
            )
        strategy = self._strategy or get_strategy()
        if strategy is None:
            raise RuntimeError(
                f"Checkpoint.{what}: this checkpoint holds no variables, so it does not know which "
                "ranks take part; call it inside `with strategy.scope():`"
            )
        return strategy

    def _describe(self) -> list[dict]:
        """What this rank holds: name, kind, shape, dtype, aggregation of each item. Local."""
        out = []
        for name, (kind, obj) in self._items.items():
            description: dict[str, Any] = {"name": name, "kind": kind}
            if kind in fmt.ARRAY_KINDS:
                description.update(shape=[int(s) for s in obj.shape], dtype=fmt.spell_dtype(obj.dtype, name))
            if isinstance(obj, DistributedVariable):
                description["aggregation"] = obj.aggregation.value
            out.append(description)
        return out

    @staticmethod
    def _get_state(name: str, obj: Any) -> Any:
        state = obj.get_state()
        try:
            copy = json.loads(json.dumps(state))
        except (TypeError, ValueError, RecursionError) as exc:
            raise TypeError(
                f"Checkpoint item {name!r}: get_state() returned {type(state).__name__} that JSON "
                f"cannot hold ({exc}); return a dict of numbers, strings, lists and dicts"
            ) from None
        if not validate.state_fits(copy):
            raise ValueError(
                f"Checkpoint item {name!r}: get_state() returned a value nested deeper than "
                f"{validate.MAX_DEPTH - 4} levels, more than a checkpoint holds"
            )
        return copy

    @staticmethod
    def _entries(descriptions: list[dict], states_by_rank: list[dict]) -> list[dict]:
        """Manifest entries (without CRCs of the data) of the agreed items. Local, the same on every rank."""
        entries = []
        for index, description in enumerate(descriptions):
            entry = dict(description)
            name = entry["name"]
            if entry["kind"] == fmt.STATE:
                # strict JSON: NaN and infinities as nulls and marks (NaN != NaN: the strict forms are compared)
                strict = [fmt.strict_state(s[name]) for s in states_by_rank]
                if all(s == strict[0] for s in strict):
                    entry["state"] = strict[0][0]
                    marks = [[["state", *path], spelling] for path, spelling in strict[0][1]]
                else:
                    entry["rank_states"] = [state for state, _ in strict]
                    marks = [
                        [["rank_states", rank, *path], spelling]
                        for rank, (_, rank_marks) in enumerate(strict)
                        for path, spelling in rank_marks
                    ]
                if marks:
                    entry[fmt.NONFINITE] = marks
            else:
                stored = fmt.stored_dtype(entry["dtype"])
                header = fmt.npy_header(entry["shape"], stored)
                entry.update(
                    file=fmt.safe_file_name(index, name),
                    data_offset=len(header),
                    header_crc32=zlib.crc32(header),
                    nbytes=int(np.prod(entry["shape"], dtype=np.int64)) * stored.itemsize,
                )
            entries.append(entry)
        return entries

    def _variables(self) -> list[tuple[str, DistributedVariable]]:
        """The variable items, by name. Local."""
        return [(name, obj) for name, (_, obj) in self._items.items() if isinstance(obj, DistributedVariable)]

    def _values(self, first_replica: bool) -> dict[str, Any]:
        """The value saved for each array item: what its policy saves for a variable (collective: with
        ``first_replica``, rank 0's mirrored components), the array itself for an array."""
        values = {name: obj for name, (kind, obj) in self._items.items() if kind == fmt.ARRAY}
        for name, var in self._variables():
            values[name] = var.policy.save_value(var, first_replica)
        return values

    def _match(self, manifest: dict, directory: Path, size: int) -> list[tuple[str, str, Any, dict]]:
        """Pair each item with its manifest entry; ``ValueError`` listing every mismatch. Local."""
        entries = {e["name"]: e for e in manifest["entries"]}
        plan, problems = [], []
        for name, (kind, obj) in self._items.items():
            entry = entries.get(name)
            if entry is None:
                held = ", ".join(map(repr, entries)) or "nothing"
                problems.append(f"{name!r} is not in the checkpoint (it holds {held})")
                continue
            if (kind == fmt.STATE) != (entry["kind"] == fmt.STATE):
                problems.append(f"{name!r} is of kind {kind!r} here but {entry['kind']!r} in the checkpoint")
                continue
            if kind == fmt.STATE:
                saved_at = len(entry.get("rank_states", ()))
                if "state" not in entry and saved_at != size:
                    problems.append(
                        f"{name!r} was saved with a different state on each of {saved_at} ranks, so it "
                        f"can only be restored on {saved_at} ranks, not {size}; to restore on another "
                        "number of ranks, make get_state() return the same (global) position on every rank"
                    )
            else:
                saved_shape = tuple(entry["shape"])
                if saved_shape != tuple(obj.shape):
                    problems.append(f"{name!r} has shape {saved_shape} in the checkpoint but {tuple(obj.shape)} here")
                saved_dtype, dtype = fmt.spell_dtype(entry["dtype"], name), fmt.spell_dtype(obj.dtype, name)
                if saved_dtype != dtype:
                    problems.append(
                        f"{name!r} has dtype {fmt.dtype_label(saved_dtype)} in the checkpoint but "
                        f"{fmt.dtype_label(dtype)} here{_bfloat16_hint(entry)}"
                    )
                if kind == fmt.ARRAY and not obj.flags.writeable:
                    problems.append(f"{name!r} is a read-only array here; pass a writeable array to restore into")
            plan.append((name, kind, obj, entry))
        if problems:
            raise ValueError(f"checkpoint {directory} does not fit this Checkpoint: " + "; ".join(problems))
        return plan

    def _roll_back(self, previous: dict[str, Any]) -> None:
        """Give iterators back the states they had before a failed restore. Local."""
        for name, state in previous.items():
            try:
                self._items[name][1].set_state(state)
            except Exception as exc:  # keep the restore's error; say what could not be undone
                warnings.warn(
                    f"Checkpoint.restore failed and could not give {name!r} back its previous state: "
                    f"{type(exc).__name__}: {exc}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    @staticmethod
    def _check_visible(directory: Path) -> None:
        """Local: ``CheckpointError`` unless this rank sees ``directory`` (the protocol names the rank)."""
        if not directory.is_dir():
            raise CheckpointError(
                f"cannot see {directory}, which rank 0 can: the checkpoint directory "
                "must be on a file system shared by all ranks (not a node-local disk)"
            )

    @staticmethod
    def _assemble(
        comm: Communicator,
        entry: dict,
        shares: list[tuple[int, int]],
        mine: np.ndarray,
        block_bytes: int,
        out: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Collective over ``comm``: the entry's bytes on every rank, from each rank's share (contiguous, in
        rank order); into ``out`` (``uint8``, the entry's size) when given."""
        if all(hi - lo == entry["nbytes"] for lo, hi in shares):  # every rank read it all (or it is empty)
            if out is None:
                return mine
            out[...] = mine
            return out
        name = f"Checkpoint.restore: entry {entry['name']!r}"
        if entry["nbytes"] <= _MAX_GATHER_BYTES:
            owners = [r for r, (lo, hi) in enumerate(shares) if hi > lo]
            if len(owners) == 1:  # one rank read it all (shares deal whole blocks): a broadcast
                full = out if out is not None else np.empty(entry["nbytes"], np.uint8)
                if comm.rank == owners[0]:
                    full[...] = mine
                return comm.broadcast(full, owners[0], name=name)
            return comm.allgather(mine, name=name, out=out)
        # in rounds: round k gathers every rank's k-th block
        full = np.empty(entry["nbytes"], np.uint8) if out is None else out
        rounds = max(fmt.block_count(hi - lo, block_bytes) for lo, hi in shares)
        for k in range(rounds):
            got = comm.allgather(mine[k * block_bytes : (k + 1) * block_bytes], name=name)
            offset = 0
            for lo, hi in shares:
                start = lo + k * block_bytes
                n = max(0, min(block_bytes, hi - start))
                full[start : start + n] = got[offset : offset + n]
                offset += n
        return full


def _block_size(block_bytes: Any, chunk_bytes: Any) -> int:
    """The block size save was given (``chunk_bytes`` is its former name), checked. Local."""
    if chunk_bytes is not None:
        if block_bytes != fmt.BLOCK_BYTES:
            raise ValueError(
                f"Checkpoint.save: got block_bytes={block_bytes!r} and chunk_bytes={chunk_bytes!r}; "
                "chunk_bytes is the former name of block_bytes: pass block_bytes only"
            )
        block_bytes = chunk_bytes
    if not isinstance(block_bytes, int) or block_bytes < 32 or block_bytes % 32:
        raise ValueError(
            "Checkpoint.save: block_bytes must be a positive multiple of 32 (the largest item "
            f"size), got {block_bytes!r}"
        )
    return block_bytes


def _bfloat16_hint(entry: dict) -> str:
    """Why an item cannot match bfloat16 entry ``entry`` when ml_dtypes is missing (else nothing). Local."""
    if entry["dtype"] != fmt.BFLOAT16 or fmt.bfloat16_dtype() is not None:
        return ""
    return f" (bfloat16 needs ml_dtypes, which is not installed: {fmt.INSTALL_BFLOAT16})"


def _direct_target(obj: Any) -> Optional[np.ndarray]:
    """The bytes a restored value can be gathered into directly (a host array item, or the host array a
    variable's policy restores into, C-contiguous and writable), as a flat ``uint8`` view; else ``None``. Local."""
    array = obj.policy.restore_target(obj) if isinstance(obj, DistributedVariable) else obj
    if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.flags.writeable):
        return None
    return array.reshape(-1).view(np.uint8)


def _check_mirrors(rank: int, what: str, fingerprints: list[dict[str, int]]) -> None:
    """Raise ``MirrorDivergenceError`` if a mirrored variable's fingerprint differs from rank 0's.

    Local, but every rank passes the same (gathered) list, so all raise together.
    """
    names = list(fingerprints[0])
    differ = diverged(names, [[mine[name] for name in names] for mine in fingerprints])
    if differ:
        raise MirrorDivergenceError(
            on_rank(
                rank,
                f"{what}: {describe(differ)} (compared by CRC-32; nothing was written). Each rank must update a "
                "mirrored variable only through collective assign/assign_add/assign_sub calls; to save rank 0's "
                "value anyway, pass check_mirrors=False",
            ),
            differ,
        )
