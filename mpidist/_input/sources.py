"""Sources: what one rank reads of a dataset, from a position, in chunks of steps.

A source turns a dataset into this rank's steps for an epoch, starting at a
position (``offset``), ``steps`` at a time: each :meth:`chunks` item is a
:class:`~mpidist._input.datasets.Chunk`. It also says what the iterator of
:mod:`mpidist._input.distributed` needs to know to keep the ranks in step:

- ``length(epoch, offset)``: the steps left, when this rank knows them
  without communication (``None`` otherwise);
- ``collective_length``: the lengths differ between ranks (``dataset_fn``),
  so the ranks agree on the shortest;
- ``exact``: the ranks run the most steps any rank has, the others reading
  :meth:`BatchSource.filler` batches (batched files); otherwise the fewest;
- ``global_position``: the position counts over all ranks, so that it
  restores at any number of ranks; else it only restores at the same one;
- ``state()`` and ``check(state, num_replicas)``: what the iterator state
  records of the source, and whether a state fits it;
- ``order(seed)``: besides ``state()``, the epoch and the position, what
  fixes the order of the source's steps (:mod:`mpidist._input.order`), and
  ``agrees_order``: the ranks agree on it at every epoch start even where
  each knows the number of steps (an ``ArrayDataset``; the other sources
  agree on it in the exchange that opens their epoch anyway).

Three kinds: :class:`ArraySource` (rows of an
:class:`~mpidist._input.datasets.ArrayDataset`), :class:`StreamSource`
(elements of any iterable, or records of files) and :class:`BatchSource`
(records of files stacked into batches). Everything here is local.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, Optional, cast

import numpy as np

from mpidist._errors import on_rank
from mpidist._input.datasets import ArrayDataset, Chunk, FileDataset, RecordBatches, array_chunks
from mpidist._input.sharding import file_shard, num_steps, per_replica_batch_size

__all__ = ["ArraySource", "BatchSource", "StreamSource", "epoch_stream", "file_fields", "file_source"]


class ArraySource:
    """Rows of an :class:`ArrayDataset`; the position is the global sample offset."""

    kind = "array"
    global_position = True
    collective_length = False
    exact = False  # every rank knows the number of steps
    warn_drops = False  # the remainder is the dataset's own, explicit choice
    agrees_order = True  # iterating is local otherwise: without it ranks with other seeds read wrong data silently
    dropped = dropped_here = 0

    def __init__(self, dataset: ArrayDataset, rank: int, size: int, auto_shard: bool) -> None:
        self._dataset, self._rank, self._size, self._auto_shard = dataset, rank, size, auto_shard
        self.seed = dataset.seed
        self.views = not dataset.shuffle  # in order, a batch is a view of the user's arrays: nothing to prepare

    def length(self, epoch: int, offset: int) -> Optional[int]:
        return num_steps(self._dataset.num_samples, self._dataset.global_batch_size, offset, self._dataset.remainder)

    def chunks(self, epoch: int, offset: int, steps: int, length: Optional[int], seed: int) -> Iterator[Chunk]:
        return array_chunks(self._dataset, epoch, offset, self._rank, self._size, self._auto_shard, steps, seed)

    def state(self) -> dict[str, Any]:
        d = self._dataset
        return {
            "num_samples": d.num_samples,
            "global_batch_size": d.global_batch_size,
            "shuffle": int(d.shuffle),
            "remainder": d.remainder,
        }

    def order(self, seed: int) -> dict[str, Any]:
        return {"seed": seed}

    def check(self, state: dict[str, Any], num_replicas: int) -> None:
        n = self._dataset.num_samples
        if state.get("num_samples") != n:
            raise ValueError(
                on_rank(
                    self._rank,
                    f"the iterator state was saved for {state.get('num_samples')} "
                    f"samples but this ArrayDataset has {n}; restore it into the same data",
                )
            )
        if state.get("shuffle") != int(self._dataset.shuffle):  # its offset counts samples in another order
            raise ValueError(
                on_rank(
                    self._rank,
                    f"the iterator state was saved with shuffle {state.get('shuffle')!r} but this ArrayDataset "
                    f"has shuffle={self._dataset.shuffle}: resuming its offset in another order would read some "
                    "samples of the epoch twice and others never; restore it into the same data",
                )
            )
        if not 0 <= state["offset"] <= n:
            raise ValueError(on_rank(self._rank, f"state offset {state['offset']} is outside 0..{n}"))


class StreamSource:
    """Elements of an iterable, ``group`` per step of which this rank takes the ``pick``-th.

    Element sharding: ``group = N, pick = rank``; no sharding: ``group = 1,
    pick = 0``. ``global_position`` is false for a rank-local stream (files,
    ``dataset_fn``), whose position only means something at the same N.
    """

    seed = 0
    exact = False  # ranks that have more steps than others drop them
    warn_drops = True
    agrees_order = False  # every rank knows the steps of a sequence; other streams agree on it while they open

    def __init__(
        self,
        kind: str,
        stream: Callable[[int], Iterable[Any]],
        length: Callable[[], Optional[int]],
        group: int,
        pick: int,
        rank: int,
        *,
        global_position: bool = True,
        collective_length: bool = False,
        fields: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.kind, self._stream, self._length, self._fields = kind, stream, length, fields
        self._group, self._pick, self._rank = group, pick, rank
        self.global_position, self.collective_length = global_position, collective_length
        self._opened: Any = None  # the last one-shot iterator read, which cannot start over
        self.dropped = 0  # elements of the epoch read by no rank: the last, incomplete group

    def length(self, epoch: int, offset: int) -> Optional[int]:
        total = self._length()
        self.dropped = 0
        if total is None:
            return None
        self.dropped = max(0, total - offset) % self._group
        return max(0, total - offset) // self._group

    @property
    def dropped_here(self) -> int:
        """Of ``dropped`` (a global source's last, incomplete group), the elements that were this rank's: 0 or 1."""
        return int(self._pick < self.dropped)

    def chunks(self, epoch: int, offset: int, steps: int, length: Optional[int], seed: int) -> Iterator[Chunk]:
        """Opens the epoch's stream now (errors are raised here, in the caller's thread), reads it lazily."""
        data = self._open(epoch)
        if length is not None and _is_sequence(data):
            indexed = cast(Sequence[Any], data)
            elements: Iterator[Any] = (indexed[offset + s * self._group + self._pick] for s in range(length))
        else:
            elements = self._walk(iter(data), offset, length)
        return self._in_chunks(elements, steps)

    def _open(self, epoch: int) -> Iterable[Any]:
        """The epoch's iterable; ``RuntimeError`` for a one-shot iterator read before."""
        data = self._stream(epoch)
        if iter(data) is data:
            if data is self._opened:
                raise RuntimeError(
                    on_rank(
                        self._rank,
                        f"the dataset is a one-shot iterator ({type(data).__name__}) that was "
                        "already read, so it cannot start over (a new iter(), a restored position, a restart "
                        "after close()). Pass a re-iterable object instead: a list, an object whose __iter__ "
                        "returns a new iterator, an ArrayDataset or a FileDataset",
                    )
                )
            self._opened = data
        return data

    def _in_chunks(self, elements: Iterator[Any], steps: int) -> Iterator[Chunk]:
        """``elements`` (one per step) as chunks of ``steps`` steps; the last one may be shorter."""
        while True:
            taken = list(itertools.islice(elements, steps))
            if taken:
                yield Chunk([self._group] * len(taken), elements=taken)
            if len(taken) < steps:
                return

    def _walk(self, it: Iterator[Any], offset: int, length: Optional[int]) -> Iterator[Any]:
        _skip(it, offset)
        produced = 0
        while length is None or produced < length:
            group = list(itertools.islice(it, self._group))
            if 0 < len(group) < self._group:  # the last, incomplete group
                self.dropped = len(group)
            if len(group) <= self._pick:
                if length is not None:
                    raise RuntimeError(
                        on_rank(
                            self._rank,
                            f"the dataset's len() promised {length} more steps from element "
                            f"{offset}, but iterating it ended after {produced}; make len() match the iteration, "
                            "or drop __len__ so that the ranks agree on the end with a collective",
                        )
                    )
                return
            yield group[self._pick]
            produced += 1

    def state(self) -> dict[str, Any]:
        """What fixes the order (a ``FileDataset``'s files, shuffle and seed), which :meth:`check` compares."""
        return self._fields()

    def order(self, seed: int) -> dict[str, Any]:
        """The dataset's own fields (a ``FileDataset``'s number of files, shuffle and seed); an iterable has none."""
        return self._fields()

    def check(self, state: dict[str, Any], num_replicas: int) -> None:
        if not self.global_position and state.get("num_replicas") != num_replicas:
            raise ValueError(
                on_rank(
                    self._rank,
                    f"this {self.kind!r} iterator position was saved at {state.get('num_replicas')} "
                    f"ranks; a rank-local position only restores at the same number of ranks, not {num_replicas}. "
                    "Use an ArrayDataset or element sharding (shard_policy='element') for positions that restore "
                    "on any number of ranks",
                )
            )
        fields = self._fields()
        if fields.keys() <= state.keys():  # a state saved before its fields were recorded carries only a seed
            differ = [f"{key} {state[key]!r} (here {value!r})" for key, value in fields.items() if state[key] != value]
            if differ:
                raise ValueError(
                    on_rank(
                        self._rank,
                        f"the iterator state was saved for another order of this {self.kind!r} dataset: "
                        f"{', '.join(differ)}; resuming its position in another order would read some records "
                        "twice and others never; restore it into the same data",
                    )
                )


class BatchSource(StreamSource):
    """Batches of a :class:`FileDataset` with a global batch size, stacked by :class:`RecordBatches`.

    The position is in records: this rank's (by file, rank-local) or all
    ranks' (by record, global). Unless the remainder is ``"drop"`` the source
    is ``exact``: ranks run the most steps any rank has, the others reading
    empty or all-padding batches (:meth:`filler`) in the last ones.
    """

    warn_drops = False  # exact, or dropping by the dataset's own remainder='drop'

    def __init__(
        self,
        kind: str,
        stream: Callable[[int], Iterable[Any]],
        batches: RecordBatches,
        global_batch_size: int,
        rank: int,
        *,
        global_position: bool,
        fields: Callable[[], dict[str, Any]],
    ) -> None:
        super().__init__(kind, stream, lambda: None, 1, 0, rank, global_position=global_position, fields=fields)
        self._batches, self._global_batch_size = batches, global_batch_size
        self.exact = batches.remainder != "drop"

    def chunks(self, epoch: int, offset: int, steps: int, length: Optional[int], seed: int) -> Iterator[Chunk]:
        records = iter(self._open(epoch))
        _skip(records, offset)
        return self._batches.chunks(records, steps)

    def filler(self, steps: int) -> Chunk:
        """``steps`` batches without records, for the last steps of a rank whose records ran out."""
        return self._batches.filler(steps)

    @property
    def has_template(self) -> bool:
        """Whether a record was read, from which :meth:`filler` takes the batches' structure."""
        return self._batches.template is not None

    def state(self) -> dict[str, Any]:
        return {**super().state(), "global_batch_size": self._global_batch_size, "remainder": self._batches.remainder}


def file_source(files: FileDataset, policy: str, rank: int, size: int) -> StreamSource:
    """The source of a :class:`FileDataset` sharded by ``policy`` (``"file"``, ``"element"`` or ``"off"``).

    By file the stream is this rank's files, and the position rank-local;
    otherwise every rank reads every file. Batched, each step reads a whole
    per-replica batch by file, else a global batch split over the ranks (the
    whole of it without sharding).
    """
    stream = _file_shard_stream(files, rank, size) if policy == "file" else epoch_stream(files)
    fields = functools.partial(file_fields, files)
    batch, remainder = files.global_batch_size, files.remainder
    if batch is None or remainder is None:  # a FileDataset has both or neither
        return StreamSource("files", stream, lambda: None, 1, 0, rank, global_position=False, fields=fields)
    per_rank = batch if policy == "off" else per_replica_batch_size(batch, size, rank)
    group, pick, parts = {"file": (per_rank, 0, 1), "element": (batch, rank, size), "off": (batch, 0, 1)}[policy]
    batches = RecordBatches(group, pick, parts, remainder, per_rank)
    kind = "file batches" if policy == "file" else "record batches"
    return BatchSource(kind, stream, batches, batch, rank, global_position=policy != "file", fields=fields)


def file_fields(files: FileDataset) -> dict[str, Any]:
    """What fixes the order of a :class:`FileDataset`'s records besides the epoch: how many files, shuffle, seed."""
    return {"files": len(files.files), "shuffle": int(files.shuffle), "seed": files.seed}


def epoch_stream(data: Any) -> Callable[[int], Iterable[Any]]:
    """The iterable to read for an epoch: ``set_epoch(epoch)`` is called when ``data`` has it."""

    def stream(epoch: int) -> Iterable[Any]:
        if isinstance(data, FileDataset):
            return data.read(data.epoch_files(epoch))
        if hasattr(data, "set_epoch"):
            data.set_epoch(epoch)
        return data

    return stream


def _file_shard_stream(files: FileDataset, rank: int, size: int) -> Callable[[int], Iterable[Any]]:
    """The records of rank's files (:func:`file_shard`) in an epoch's file order."""

    def stream(epoch: int) -> Iterable[Any]:
        ordered = files.epoch_files(epoch)
        return files.read([ordered[i] for i in file_shard(len(files.files), rank, size)])

    return stream


def _is_sequence(data: Any) -> bool:
    return isinstance(data, (collections.abc.Sequence, np.ndarray)) and not isinstance(data, (str, bytes))


def _skip(it: Iterator[Any], count: int) -> None:
    """Advance ``it`` by ``count`` elements (fewer if it ends): the elements before a position."""
    next(itertools.islice(it, count, count), None)
