"""Datasets that know nothing of MPI: arrays read in global batches, files, the input context.

:class:`ArrayDataset` and :class:`FileDataset` iterate serially (one
replica) on their own; :func:`mpidist._input.factories.distribute_dataset` shares them
out over the ranks with the arithmetic of :mod:`mpidist._input.sharding`.
:class:`InputContext` is what a ``dataset_fn`` learns about its rank.
:class:`RecordBatches` stacks records into batches, and :class:`Chunk` is
the unit the input pipeline moves: several consecutive steps of one rank's
input, prepared (gathered, copied to the device) and agreed on at once.
Everything here is local.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from mpidist._comm.backend import array_module, is_device_array
from mpidist._input.sharding import (
    batch_plan,
    batch_rows,
    check_count,
    check_rank,
    check_remainder,
    epoch_order,
    num_steps,
    per_replica_batch_size,
)
from mpidist._values.nest import flatten, map_structure, map_structure_with_path, pack_sequence_as

if TYPE_CHECKING:
    from mpidist._typing import Array

__all__ = ["ArrayDataset", "Chunk", "FileDataset", "InputContext", "RecordBatches", "array_chunks"]


class InputContext:
    """What ``dataset_fn`` of :func:`distribute_datasets_from_function` learns about its rank. Local."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1) -> None:
        check_rank(input_pipeline_id, num_input_pipelines)
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = check_count("num_replicas_in_sync", num_replicas_in_sync, 1)

    @property
    def num_input_pipelines(self) -> int:
        """Number of input pipelines: one per rank."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's id: the rank."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas taking part in each step."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; ``ValueError`` unless divisible."""
        return per_replica_batch_size(global_batch_size, self._num_replicas_in_sync, self._input_pipeline_id)

    def shard(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """This pipeline's elements of ``iterable``: ``id, id + n, id + 2n, ...``."""
        return itertools.islice(iterable, self._input_pipeline_id, None, self._num_input_pipelines)

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, input_pipeline_id="
            f"{self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class ArrayDataset:
    """Arrays with a common first dimension, read in global batches of ``global_batch_size`` rows.

    Iterating it directly gives the batches of one replica (serial use).
    :func:`distribute_dataset` splits each global batch over the ranks.

    Args:
        arrays: an array or a nest (tuple, list, dict) of NumPy or CuPy arrays
            with the same length along axis 0.
        global_batch_size: samples per step, over all replicas.
        shuffle: visit the samples in :func:`epoch_order` ``(seed, epoch)``.
        seed: non-negative int; every rank must pass the same (a distributed
            dataset checks it, with the length, batch size and epoch, when
            each epoch starts).
        epoch: the epoch that the next ``iter()`` reads; see :meth:`set_epoch`.
        remainder: what to do with the last ``num_samples % global_batch_size``
            samples: ``"drop"`` them (training), read them as a ``"partial"``
            (smaller) last batch, or pad that batch to full size and yield
            ``(batch, mask)`` for every step, ``mask`` a bool array (``False``
            on padding rows). With ``"partial"`` or ``"mask"`` every sample is
            read exactly once per epoch.

    Unshuffled batches may be read-only views of your arrays.
    """

    def __init__(
        self,
        arrays: Any,
        global_batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        remainder: str = "drop",
    ) -> None:
        leaves = flatten(arrays)
        paths: list[tuple[str, int]] = []

        def length(path: str, leaf: Any) -> None:
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or len(leaf.shape) == 0:
                raise TypeError(
                    f"ArrayDataset: {path or 'the array'} must be an array with at least one "
                    f"dimension, got {type(leaf).__name__}; wrap lists with numpy.asarray"
                )
            paths.append((path or "the array", int(leaf.shape[0])))

        map_structure_with_path(length, arrays)
        if len({n for _, n in paths}) > 1:
            listed = ", ".join(f"{p}: {n}" for p, n in paths)
            raise ValueError(f"ArrayDataset: the arrays must have the same length along axis 0, got {listed}")
        check_remainder(remainder)
        self._arrays = arrays
        self._leaves = leaves
        self._pack = functools.partial(pack_sequence_as, arrays)
        self._pack_masked = _masked(self._pack)
        self._n = paths[0][1]
        self.global_batch_size = check_count("global_batch_size", global_batch_size, 1)
        self.shuffle = bool(shuffle)
        self.seed = check_count("seed", seed)
        self.epoch = check_count("epoch", epoch)
        self.remainder = remainder

    @property
    def num_samples(self) -> int:
        """Length of the arrays along axis 0."""
        return self._n

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` (its shuffle order) from the next ``iter()`` on. Local."""
        self.epoch = check_count("epoch", epoch)

    def __len__(self) -> int:
        """Steps per epoch at one replica."""
        return num_steps(self._n, self.global_batch_size, 0, self.remainder)

    def __iter__(self) -> Iterator[Any]:
        for chunk in array_chunks(self, self.epoch, 0, 0, 1, True, 1, self.seed):
            for element, _ in chunk.steps():
                yield element

    def __repr__(self) -> str:
        return (
            f"ArrayDataset({self._n} samples, global_batch_size={self.global_batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, remainder={self.remainder!r})"
        )

    def _gather(
        self, order: Optional[np.ndarray], planned: list[tuple[int, int, int]], width: Optional[int], reuse: _Reuse
    ) -> Chunk:
        """The chunk of the ``planned`` steps (``(lo, hi, advance)`` each): one array per leaf holding their rows."""
        if width is None and len(planned) == 1:  # the common case, kept short
            lo, hi, advance = planned[0]
            if order is None:
                leaves = [_read_only(leaf[lo:hi]) for leaf in self._leaves]
            else:
                index = order[lo:hi]
                leaves = [reuse.take(i, leaf, index) for i, leaf in enumerate(self._leaves)]
            return Chunk([advance], pack=self._pack, leaves=leaves, bounds=[(0, hi - lo)])
        advances = [advance for _, _, advance in planned]
        if width is None and (len(planned) == 1 or all(a[1] == b[0] for a, b in zip(planned, planned[1:]))):
            lo, hi = planned[0][0], planned[-1][1]  # consecutive positions: one slice
            if order is None:
                leaves = [_read_only(leaf[lo:hi]) for leaf in self._leaves]
            else:
                leaves = [reuse.take(i, leaf, order[lo:hi]) for i, leaf in enumerate(self._leaves)]
            edges = list(itertools.accumulate([0] + [b - a for a, b, _ in planned]))
            return Chunk(advances, pack=self._pack, leaves=leaves, bounds=list(zip(edges, edges[1:])))
        indices, masks, bounds, start = [], [], [], 0
        for lo, hi, _ in planned:
            rows = hi - lo
            pad = 0 if width is None else width - rows
            indices.append(np.arange(lo, hi))
            if pad:
                indices.append(np.arange(pad) % self._n)
            if width is not None:
                masks.append(np.arange(width) < rows)
            bounds.append((start, start + rows + pad))
            start += rows + pad
        index = np.concatenate(indices)
        if order is not None:
            index = order[index]
        leaves = [_take(leaf, index) for leaf in self._leaves]
        if width is None:
            return Chunk(advances, pack=self._pack, leaves=leaves, bounds=bounds)
        return Chunk(advances, pack=self._pack_masked, leaves=leaves + [np.concatenate(masks)], bounds=bounds)


def array_chunks(
    dataset: ArrayDataset, epoch: int, offset: int, rank: int, size: int, auto_shard: bool, steps: int, seed: int
) -> Iterator[Chunk]:
    """Rank's batches of ``dataset`` from global sample ``offset`` on, ``steps`` per chunk (one gather per leaf)."""
    n, batch = dataset.num_samples, dataset.global_batch_size
    order = epoch_order(n, epoch, seed) if dataset.shuffle else None
    width = (batch // size if auto_shard else batch) if dataset.remainder == "mask" else None
    plan = batch_plan(n, batch, rank, size, offset=offset, remainder=dataset.remainder, auto_shard=auto_shard)
    reuse = _Reuse(len(dataset._leaves))
    for first in plan:
        planned = [first, *itertools.islice(plan, steps - 1)] if steps > 1 else [first]
        yield dataset._gather(order, planned, width, reuse)


def _masked(pack: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
    """``pack`` for leaves whose last one is the mask: ``(pack(leaves[:-1]), mask)``."""
    return lambda leaves: (pack(leaves[:-1]), leaves[-1])


def _read_only(view: Array) -> Array:
    """``view`` (a fresh view of the user's array) made read-only where NumPy allows it."""
    if type(view) is np.ndarray:
        view.flags.writeable = False
    return view


class _Reuse:
    """The arrays of the last few gathers, gathered into again once nothing else refers to them. Local.

    A loop drops each batch before it asks for the next one or two, so in
    steady state a shuffled gather writes into memory it used a few steps
    before instead of allocating a new array (which glibc, depending on the
    heap's layout, may hand back to the system and fault in again each step:
    about 100 us for a 200 KB batch). An array that anything else still
    refers to (the batch the caller keeps, a view of it, the chunk being
    consumed, a prefetch queue) is never written into.
    """

    __slots__ = ("_held",)
    KEEP = 3  # arrays kept per leaf: the batch in use, the chunk being consumed, one free

    def __init__(self, leaves: int) -> None:
        self._held: list[list[np.ndarray]] = [[] for _ in range(leaves)]

    @staticmethod
    def _count(ring: list[np.ndarray], j: int) -> int:
        return sys.getrefcount(ring[j])

    def take(self, i: int, leaf: Array, index: np.ndarray) -> Array:
        """Rows ``index`` of leaf ``i``: into one of its kept arrays that no one else holds, else a new one."""
        if type(leaf) is not np.ndarray:
            return _take(leaf, index)
        ring = self._held[i]
        for j in range(len(ring)):
            if self._count(ring, j) == _ALONE and ring[j].shape[0] == index.size:
                free = ring.pop(j)
                ring.append(free)
                return np.take(leaf, index, axis=0, out=free, mode="clip")  # our indices are in range
        taken = leaf[index]  # a NumPy leaf here: what _take does for one
        ring.append(taken)
        if len(ring) > self.KEEP:
            del ring[0]
        return taken


def _alone() -> int:
    """What :meth:`_Reuse._count` reads for an array that only its ring refers to (differs between Pythons)."""
    ring = [np.empty(1)]
    return _Reuse._count(ring, 0)


_ALONE = _alone()


def _take(leaf: Array, index: np.ndarray) -> Array:
    """Rows ``index`` of ``leaf`` (a NumPy or CuPy array) as a new contiguous array."""
    if type(leaf) is not np.ndarray and is_device_array(leaf):
        return leaf[array_module(leaf).asarray(index)]
    return leaf[index]


class FileDataset:
    """Records read from a list of files: ``reader(path)`` yields the records of one file.

    Iterating it directly reads every file in the epoch's order (serial use).
    :func:`distribute_dataset` shares the files out by file when there are
    at least as many files as ranks, else by record (``shard_policy``).

    Without ``global_batch_size`` each step is one record per rank (an
    element stream). With it, records are stacked into batches as an
    :class:`ArrayDataset`'s rows are: ``global_batch_size`` records per step
    over all replicas, ``global_batch_size / N`` per rank.

    Args:
        files: paths (str or ``os.PathLike``).
        reader: called with one path, returns an iterable of records (each a
            number, an array or a nest of them, all of the same structure).
        global_batch_size: records per step, over all replicas; ``None``
            (default): no batching.
        remainder: with ``global_batch_size``, what to do with the records
            that do not fill a last batch (on each rank, when sharding by
            file): read them as ``"partial"`` (smaller) batches (default),
            pad those batches and yield ``(batch, mask)`` for every step
            (``"mask"``), or ``"drop"`` them. With ``"partial"`` or
            ``"mask"`` every record is read exactly once per epoch.
        shuffle: visit the files in :func:`epoch_order` ``(seed, epoch)``.
        seed: non-negative int, the same on every rank (checked as an
            :class:`ArrayDataset`'s is).
        epoch: the epoch the next ``iter()`` reads; see :meth:`set_epoch`.
    """

    def __init__(
        self,
        files: Sequence[Union[str, os.PathLike[str]]],
        reader: Callable[[str], Iterable[Any]],
        *,
        global_batch_size: Optional[int] = None,
        remainder: Optional[str] = None,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
    ) -> None:
        if isinstance(files, (str, bytes, os.PathLike)):
            raise TypeError(f"FileDataset needs a list of paths, got the single path {files!r}: pass [path]")
        self.files = [os.fspath(f) for f in files]
        if not callable(reader):
            raise TypeError(f"FileDataset: reader must be callable (path -> iterable), got {type(reader).__name__}")
        if global_batch_size is None and remainder is not None:
            raise ValueError(f"FileDataset: remainder={remainder!r} applies to batches; pass global_batch_size too")
        self.reader = reader
        self.global_batch_size = (
            None if global_batch_size is None else check_count("global_batch_size", global_batch_size, 1)
        )
        self.remainder = None if global_batch_size is None else remainder or "partial"
        if self.remainder is not None:
            check_remainder(self.remainder)
        self.shuffle = bool(shuffle)
        self.seed = check_count("seed", seed)
        self.epoch = check_count("epoch", epoch)

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` (its file order) from the next ``iter()`` on. Local."""
        self.epoch = check_count("epoch", epoch)

    def epoch_files(self, epoch: Optional[int] = None) -> list[str]:
        """The files in the order epoch ``epoch`` (default: the current one) reads them."""
        order = epoch_order(len(self.files), self.epoch if epoch is None else epoch, self.seed, self.shuffle)
        return [self.files[i] for i in order]

    def read(self, files: Iterable[str]) -> Iterator[Any]:
        """The records of ``files``, file after file."""
        for path in files:
            yield from self.reader(path)

    def __iter__(self) -> Iterator[Any]:
        records = self.read(self.epoch_files())
        batch, remainder = self.global_batch_size, self.remainder
        if batch is None or remainder is None:  # both or neither
            return records
        batches = RecordBatches(batch, 0, 1, remainder, batch)
        return (element for chunk in batches.chunks(records, 1) for element, _ in chunk.steps())

    def __repr__(self) -> str:
        batching = (
            ""
            if self.global_batch_size is None
            else f", global_batch_size={self.global_batch_size}, remainder={self.remainder!r}"
        )
        return (
            f"FileDataset({len(self.files)} files{batching}, shuffle={self.shuffle}, seed={self.seed}, "
            f"epoch={self.epoch})"
        )


class RecordBatches:
    """Batches of a stream of records: each step reads ``group`` records and takes share ``pick`` of
    ``parts`` of them (:func:`batch_rows`), stacked along a new first axis. Local.

    With ``remainder="mask"`` every batch is padded to ``width`` rows with
    records of its group and comes with a mask (``False`` on padding); with
    ``"drop"`` a last, incomplete group is skipped. ``template`` is a record
    seen last, from which :meth:`filler` builds batches when this rank has
    no records left.
    """

    def __init__(self, group: int, pick: int, parts: int, remainder: str, width: int) -> None:
        check_rank(pick, parts)
        check_remainder(remainder)
        self.group, self.pick, self.parts, self.remainder = group, pick, parts, remainder
        self.width = width if remainder == "mask" else None
        self.template: Any = None

    def chunks(self, records: Iterator[Any], steps: int) -> Iterator[Chunk]:
        """Chunks of up to ``steps`` batches read from ``records``; the last chunk has fewer."""
        while True:
            shares, advances = [], []
            for _ in range(steps):
                group = list(itertools.islice(records, self.group))  # the records of one step, over all ranks
                if not group or (len(group) < self.group and self.remainder == "drop"):
                    break
                self.template = group[0]
                lo, hi = batch_rows(0, len(group), self.group, self.pick, self.parts)
                shares.append((group[lo:hi], group))
                advances.append(len(group))
            if shares:
                yield self._stack(shares, advances)
            if len(shares) < steps:
                return

    def filler(self, steps: int) -> Chunk:
        """``steps`` batches without a record: empty (``"partial"``) or all padding (``"mask"``).

        ``ValueError`` when no record has been read yet (their shapes are unknown).
        """
        if self.template is None:
            raise ValueError("no record has been read, so the shapes of an empty batch are unknown")
        return self._stack([([], [self.template])] * steps, [0] * steps)

    def _stack(self, shares: list[tuple[list[Any], list[Any]]], advances: list[int]) -> Chunk:
        """One array per leaf holding the batches of every step: ``(share, pool)`` each, padded from ``pool``."""
        rows: list[Any] = []
        masks: list[bool] = []
        bounds: list[tuple[int, int]] = []
        for share, pool in shares:
            pad = [] if self.width is None else [pool[i % len(pool)] for i in range(self.width - len(share))]
            bounds.append((len(rows), len(rows) + len(share) + len(pad)))
            rows += share + pad
            masks += [True] * len(share) + [False] * len(pad)
        if rows:
            leaves = [np.stack(column) for column in zip(*(flatten(row) for row in rows))]
        else:
            leaves = [np.asarray(leaf)[np.newaxis][:0] for leaf in flatten(self.template)]
        pack = functools.partial(pack_sequence_as, self.template)
        if self.width is None:
            return Chunk(advances, pack=pack, leaves=leaves, bounds=bounds)
        return Chunk(advances, pack=_masked(pack), leaves=leaves + [np.array(masks, dtype=bool)], bounds=bounds)


class Chunk:
    """Several consecutive steps of one rank's input, prepared and agreed on at once.

    A distributed dataset's chunks hold ``steps_per_transfer`` steps (the
    last of an epoch may hold fewer), each with its global ``advance``: how
    far the step moves the position. Either ``elements`` (one nest per
    step), or an array batch: ``leaves`` holding the rows of all steps,
    step ``i`` being rows ``bounds[i]``, turned into the dataset's
    structure by ``pack``.
    """

    __slots__ = ("advances", "elements", "pack", "leaves", "bounds")

    def __init__(
        self,
        advances: list[int],
        *,
        elements: Optional[list[Any]] = None,
        pack: Optional[Callable[[Sequence[Any]], Any]] = None,
        leaves: Optional[list[Any]] = None,
        bounds: Optional[list[tuple[int, int]]] = None,
    ) -> None:
        self.advances = advances
        self.elements = elements
        self.pack = pack
        self.leaves: list[Any] = [] if leaves is None else leaves
        self.bounds: list[tuple[int, int]] = [] if bounds is None else bounds

    def __len__(self) -> int:
        return len(self.advances)

    def map_leaves(self, fn: Callable[[Any], Any]) -> Chunk:
        """The same steps with ``fn`` applied to every leaf (of every element, or of the batch arrays)."""
        if self.elements is not None:
            return Chunk(self.advances, elements=[map_structure(fn, e) for e in self.elements])
        return Chunk(self.advances, pack=self.pack, leaves=[fn(x) for x in self.leaves], bounds=self.bounds)

    def steps(self) -> list[tuple[Any, int]]:
        """``(element, advance)`` of each step, in order."""
        if self.elements is not None:
            return list(zip(self.elements, self.advances))
        pack = self.pack
        assert pack is not None, "a chunk holds either elements or leaves with their pack"
        if len(self.bounds) == 1:
            return [(pack(self.leaves), self.advances[0])]
        return [(pack([x[a:b] for x in self.leaves]), adv) for (a, b), adv in zip(self.bounds, self.advances)]
