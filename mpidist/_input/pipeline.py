"""Input pipelines: sharding by (rank, size), distributed datasets, prefetch, multi-step loops.

One rank is one replica, so a dataset is distributed by giving each rank its
share of every step:

- :func:`distribute_dataset` over any iterable: at step ``s`` rank ``r``
  receives element ``s * N + r`` (``auto_shard=True``) or every element
  (``auto_shard=False``). Over an :class:`ArrayDataset` (arrays with a common
  first dimension and a *global* batch size ``B``) each step's ``B`` rows are
  split into ``B / N`` rows per rank, shuffled by ``(seed, epoch)`` without
  communication. Over a :class:`FileDataset` the files are shared out by file
  when there are at least ``N`` of them, else the records are; with a
  ``global_batch_size`` its records are stacked into batches.
- :func:`distribute_datasets_from_function` calls your function with an
  :class:`InputContext` on every rank and iterates what it returns.
- :func:`run_steps_on_dataset` runs several steps per call and records
  their outputs in a :class:`MultiStepContext`.

Every rank runs the same number of steps. When the number is known on every
rank without communication (``len()`` of the dataset, array datasets), no
collective is made. Otherwise ranks agree with one small allreduce (the
minimum and maximum of the steps each rank has ready: three int64) per *chunk* of steps
(``steps_per_transfer``, default 1): the latency of one small allreduce
(and of the strategy's metadata check, ``check_collectives``) per chunk;
larger chunks divide that cost. A rank whose source raises tells the others through the
same allreduce, so they raise too instead of waiting. Element streams drop
the elements past the last step that every rank has; each rank warns once
with how many, on that rank and in total (``drop_remainder=True`` drops them
silently). Batched file datasets are exact instead (unless their
``remainder`` is ``"drop"``): the ranks run the most steps any rank has, and
a rank whose records ran out reads empty (``"partial"``) or all-padding
(``"mask"``) batches in the last ones, so every record is read once.

Elements arrive as nests of :class:`~mpidist.PerReplica` holding arrays of
the strategy's array module (NumPy, or CuPy on the rank's GPU); numbers
become 0-d arrays, other leaves (strings, ...) are passed as they are. A
background thread prepares the next ``prefetch`` chunks; on a GPU it also
starts their copy to the device on a side CUDA stream. The thread never
talks to other ranks; it runs your iterable's code.

An iterator's position (``get_state()``) is a JSON-serialisable dict. For
array datasets and element sharding it is global (the number of samples
consumed in the epoch, whatever the number of ranks), so a checkpoint taken
at N ranks resumes at M ranks with exactly the samples not yet seen.

The arithmetic (which rows, elements and files a rank reads) lives in the
pure functions of :mod:`mpidist._input.sharding`; the datasets themselves in
:mod:`mpidist._input.datasets`. This module never calls MPI itself: its one
collective goes through the strategy's communicator.
"""
from __future__ import annotations

import collections
import collections.abc
import itertools
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import numpy as np

from mpidist._input.datasets import ArrayDataset, FileDataset, InputContext, Chunk, RecordBatches
from mpidist._comm.reduce_op import ReduceOp
from mpidist._input.sharding import (
    SHARD_POLICIES,
    check_count,
    choose_shard_policy,
    file_shard,
    num_steps,
    per_replica_batch_size,
)
from mpidist._input.prefetch import Converter, Prefetcher, default_depth, wrap
from mpidist._values.values import select_replica

if TYPE_CHECKING:
    from mpidist._distribute.extended import AnyReduceOp
    from mpidist._distribute.strategy import MPIStrategy

# ArrayDataset, FileDataset and InputContext are re-exported: this module is the input API.
__all__ = [
    "ArrayDataset",
    "DistributedDataset",
    "DistributedIterator",
    "FileDataset",
    "InputContext",
    "MultiStepContext",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "run_steps_on_dataset",
]

logger = logging.getLogger("mpidist.data")

STATE_FORMAT = "mpidist.data/1"


# --------------------------------------------------------------------------
# Sources: what one rank reads, from a position
# --------------------------------------------------------------------------


def _length_of(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:
        return None


def _is_sequence(data: Any) -> bool:
    return isinstance(data, (collections.abc.Sequence, np.ndarray)) and not isinstance(data, (str, bytes))


class _ArraySource:
    """Rows of an :class:`ArrayDataset`; the position is the global sample offset."""

    kind = "array"
    global_position = True
    collective_length = False
    exact = False  # every rank knows the number of steps
    warn_drops = False  # the remainder is the dataset's own, explicit choice
    dropped = dropped_here = 0

    def __init__(self, dataset: ArrayDataset, rank: int, size: int, auto_shard: bool) -> None:
        self._dataset, self._rank, self._size, self._auto_shard = dataset, rank, size, auto_shard
        self.seed = dataset.seed
        self.views = not dataset.shuffle  # in order, a batch is a view of the user's arrays: nothing to prepare

    def length(self, epoch: int, offset: int) -> Optional[int]:
        return num_steps(self._dataset.num_samples, self._dataset.global_batch_size, offset, self._dataset.remainder)

    def chunks(self, epoch: int, offset: int, steps: int, length: Optional[int], seed: int) -> Iterator[Chunk]:
        return self._dataset._chunks(epoch, offset, self._rank, self._size, self._auto_shard, steps, seed)

    def state(self) -> dict[str, Any]:
        d = self._dataset
        return {"num_samples": d.num_samples, "global_batch_size": d.global_batch_size,
                "shuffle": int(d.shuffle), "remainder": d.remainder}

    def check(self, state: dict[str, Any], num_replicas: int) -> None:
        n = self._dataset.num_samples
        if state.get("num_samples") != n:
            raise ValueError(f"rank {self._rank}: the iterator state was saved for {state.get('num_samples')} samples "
                             f"but this ArrayDataset has {n}; restore it into the same data")
        if not 0 <= state["offset"] <= n:
            raise ValueError(f"rank {self._rank}: state offset {state['offset']} is outside 0..{n}")


class _StreamSource:
    """Elements of an iterable, ``group`` per step of which this rank takes the ``pick``-th.

    Element sharding: ``group = N, pick = rank``; no sharding: ``group = 1,
    pick = 0``. ``global_position`` is false for a rank-local stream (files,
    ``dataset_fn``), whose position only means something at the same N.
    """

    seed = 0
    exact = False  # ranks that have more steps than others drop them
    warn_drops = True

    def __init__(self, kind: str, stream: Callable[[int], Iterable[Any]], length: Callable[[], Optional[int]],
                 group: int, pick: int, rank: int, *, global_position: bool = True,
                 collective_length: bool = False) -> None:
        self.kind, self._stream, self._length = kind, stream, length
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
            elements: Iterator[Any] = (data[offset + s * self._group + self._pick] for s in range(length))
        else:
            elements = self._walk(iter(data), offset, length)
        return self._blocks(elements, steps)

    def _open(self, epoch: int) -> Iterable[Any]:
        """The epoch's iterable; ``RuntimeError`` for a one-shot iterator read before."""
        data = self._stream(epoch)
        if iter(data) is data:
            if data is self._opened:
                raise RuntimeError(
                    f"rank {self._rank}: the dataset is a one-shot iterator ({type(data).__name__}) that was "
                    "already read, so it cannot start over (a new iter(), a restored position, a restart "
                    "after close()). Pass a re-iterable object instead: a list, an object whose __iter__ "
                    "returns a new iterator, an ArrayDataset or a FileDataset")
            self._opened = data
        return data

    def _blocks(self, elements: Iterator[Any], steps: int) -> Iterator[Chunk]:
        while True:
            block = list(itertools.islice(elements, steps))
            if block:
                yield Chunk([self._group] * len(block), elements=block)
            if len(block) < steps:
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
                        f"rank {self._rank}: the dataset's len() promised {length} more steps from element "
                        f"{offset}, but iterating it ended after {produced}; make len() match the iteration, "
                        "or drop __len__ so that the ranks agree on the end with a collective")
                return
            yield group[self._pick]
            produced += 1

    def state(self) -> dict[str, Any]:
        return {}

    def check(self, state: dict[str, Any], num_replicas: int) -> None:
        if not self.global_position and state.get("num_replicas") != num_replicas:
            raise ValueError(
                f"rank {self._rank}: this {self.kind!r} iterator position was saved at {state.get('num_replicas')} "
                f"ranks; a rank-local position only restores at the same number of ranks, not {num_replicas}. "
                "Use an ArrayDataset or element sharding (shard_policy='element') for positions that restore "
                "on any number of ranks")


class _BatchSource(_StreamSource):
    """Batches of a :class:`FileDataset` with a global batch size, stacked by :class:`RecordBatches`.

    The position is in records: this rank's (by file, rank-local) or all
    ranks' (by record, global). Unless the remainder is ``"drop"`` the source
    is ``exact``: ranks run the most steps any rank has, the others reading
    empty or all-padding batches (:meth:`filler`) in the last ones.
    """

    warn_drops = False  # exact, or dropping by the dataset's own remainder='drop'

    def __init__(self, kind: str, stream: Callable[[int], Iterable[Any]], batches: RecordBatches,
                 global_batch_size: int, rank: int, *, global_position: bool) -> None:
        super().__init__(kind, stream, lambda: None, 1, 0, rank, global_position=global_position)
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
        return {"global_batch_size": self._global_batch_size, "remainder": self._batches.remainder}


def _skip(it: Iterator[Any], count: int) -> None:
    """Advance ``it`` by ``count`` elements (fewer if it ends): the elements before a position."""
    next(itertools.islice(it, count, count), None)


def _epoch_stream(data: Any) -> Callable[[int], Iterable[Any]]:
    """The iterable to read for an epoch: ``set_epoch(epoch)`` is called when ``data`` has it."""
    def stream(epoch: int) -> Iterable[Any]:
        if isinstance(data, FileDataset):
            return data.read(data.epoch_files(epoch))
        if hasattr(data, "set_epoch"):
            data.set_epoch(epoch)
        return data

    return stream


def _require_iterable(data: Any, what: str) -> None:
    try:
        iter(data)
    except TypeError:
        raise TypeError(f"{what} must be iterable (a list, generator, ArrayDataset, FileDataset, ...), "
                        f"got {type(data).__name__}") from None


# --------------------------------------------------------------------------
# Distributed datasets and iterators
# --------------------------------------------------------------------------


class DistributedDataset:
    """A dataset whose ``iter()`` gives each rank its share of every step.

    Created by :func:`distribute_dataset` or
    :func:`distribute_datasets_from_function`. Each ``iter()`` starts the
    current epoch over (:meth:`set_epoch`). Creating iterators is local;
    iterating is collective where the number of steps is not known in
    advance (see the module docstring).

    Attributes:
        shard_policy: how the data is shared out: ``"batch"`` (array rows of
            each global batch), ``"element"``, ``"file"``, ``"function"``
            (your ``dataset_fn``) or ``"off"`` (every rank reads everything).
        prefetch: chunks prepared ahead in a background thread (0: none; chosen by
            :func:`~mpidist._input.prefetch.default_depth` unless given).
        steps_per_transfer: steps gathered and copied to the device together.
    """

    def __init__(self, strategy: "MPIStrategy", source: Any, *, shard_policy: str, prefetch: Optional[int],
                 steps_per_transfer: int, epoch: int, drop_remainder: Optional[bool] = None) -> None:
        self._strategy, self._source = strategy, source
        self.shard_policy = shard_policy
        self._warn_drops = source.warn_drops and not drop_remainder
        communicator = strategy.communicator
        self.prefetch = (default_depth(communicator.backend, communicator.local_size, getattr(source, "views", False))
                         if prefetch is None else check_count("prefetch", prefetch))
        self.steps_per_transfer = check_count("steps_per_transfer", steps_per_transfer, 1)
        self._epoch = check_count("epoch", epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` reads."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` (its shuffle order) from the next ``iter()`` on. Local; call it on every rank."""
        self._epoch = check_count("epoch", epoch)

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self)

    def __len__(self) -> int:
        """Steps of a whole epoch, when every rank knows it without communication."""
        steps = None if self._source.collective_length else self._source.length(self._epoch, 0)
        if steps is None:
            raise TypeError(f"the number of steps of this {self.shard_policy}-sharded dataset is only known by "
                            "iterating it (its dataset has no len(), or ranks read different data)")
        return steps

    def _report_dropped(self, here: int, total: int, epoch: int) -> None:
        """Warn, once per dataset, that ``total`` elements (``here`` of them this rank's) were dropped. Local."""
        if total > 0 and self._warn_drops:
            self._warn_drops = False
            warnings.warn(
                f"rank {self._strategy.rank}: mpidist dropped {total} element(s) of epoch {epoch} ({here} on this "
                f"rank) so that all {self._strategy.num_replicas_in_sync} ranks run the same number of steps "
                f"({self.shard_policy} sharding). Pass drop_remainder=True to drop them without this warning; to "
                "see every element, read the data as an ArrayDataset with remainder='partial' or 'mask', or as a "
                "FileDataset with a global_batch_size", UserWarning, stacklevel=4)

    def iterator_from_state(self, state: dict[str, Any]) -> "DistributedIterator":
        """A new iterator positioned at ``state`` (from :meth:`DistributedIterator.get_state`). Local."""
        iterator = iter(self)
        iterator.set_state(state)
        return iterator

    def __repr__(self) -> str:
        return (f"<DistributedDataset {self.shard_policy}-sharded over {self._strategy.num_replicas_in_sync} "
                f"replicas, epoch {self._epoch}, prefetch {self.prefetch}>")


class DistributedIterator:
    """Iterator over a :class:`DistributedDataset`: each ``next()`` is one step.

    ``next()`` returns this rank's element as a nest of ``PerReplica``. It is
    collective (one allreduce per chunk of ``steps_per_transfer`` steps) when
    the number of steps is not known in advance, and for a
    ``dataset_fn``-built dataset the first ``next()`` agrees on the length
    (one allreduce); otherwise it is local. Every rank must call it the same
    number of times.
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset, self._source, self._strategy = dataset, dataset._source, dataset._strategy
        self._rank = self._strategy.rank
        self._epoch, self._offset, self._seed = dataset.epoch, 0, self._source.seed
        self._pipe: Optional[Prefetcher] = None
        self._reset()

    def _reset(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        self._pipe = None
        self._converter: Optional[Converter] = None
        self._ready: collections.deque[tuple[Any, int]] = collections.deque()
        self._length: Optional[int] = None
        self._final = False  # no step after those in _ready
        self._done = False  # exhausted: next() raises StopIteration without communicating
        self._dropped = 0  # steps this rank read that the others had no step for (rank-local sources)

    # -- position (local) ------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch this iterator reads."""
        return self._epoch

    @property
    def offset(self) -> int:
        """Position in the epoch: samples (arrays) or elements consumed over all ranks; steps if rank-local."""
        return self._offset

    def get_state(self) -> dict[str, Any]:
        """The position as a JSON-serialisable dict of ints and strings. Local; the same on every rank.

        Keys: ``format``, ``kind``, ``epoch``, ``offset``, ``seed``,
        ``num_replicas`` and, for array datasets, ``num_samples``,
        ``global_batch_size``, ``shuffle``, ``remainder``. Steps prefetched
        but not yet returned by ``next()`` do not count.
        """
        state = {"format": STATE_FORMAT, "kind": self._source.kind, "epoch": self._epoch,
                 "offset": self._offset, "seed": self._seed,
                 "num_replicas": self._strategy.num_replicas_in_sync}
        state.update(self._source.state())
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`get_state` dict, possibly from another number of ranks). Local.

        The epoch, offset and shuffle seed are taken from ``state``. Raises
        ``ValueError`` when the state belongs to another kind of dataset or
        to different data.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"rank {self._rank}: not an mpidist iterator state (expected a dict with "
                             f"format {STATE_FORMAT!r}), got {state!r}")
        if state.get("kind") != self._source.kind:
            raise ValueError(f"rank {self._rank}: the state is of a {state.get('kind')!r} iterator, but this "
                             f"iterator reads a {self._source.kind!r} source")
        for key in ("epoch", "offset", "seed"):
            check_count(f"state[{key!r}]", state.get(key))
        self._source.check(state, self._strategy.num_replicas_in_sync)
        self._reset()
        self._epoch, self._offset = check_count("epoch", state["epoch"]), state["offset"]
        self._seed = check_count("seed", state["seed"])

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        if not self._ready:
            self._refill()
        element, advance = self._ready.popleft()
        self._offset += advance
        return wrap(self._rank, element)

    def _refill(self) -> None:
        if self._done:
            raise StopIteration
        if self._pipe is None:
            self._start()
        if not self._final:
            try:
                chunk = self._pipe.get()
            except Exception:
                if self._length is None:  # tell the other ranks, which would wait in the agreement
                    self._exchange_steps(-1 - self._rank)
                raise
            steps = [] if chunk is None else self._finish(chunk).steps()
            count = len(steps)
            if self._length is None:
                count = self._agree_steps(count)
                if count > len(steps):
                    steps += self._fill(count - len(steps))
                self._final = count < self._dataset.steps_per_transfer
                self._dropped += len(steps) - count
            elif chunk is None:
                self._final = True
            self._ready.extend(steps[:count])
        if not self._ready:
            self._end_epoch()
            raise StopIteration

    def _end_epoch(self) -> None:
        """Close, then warn about dropped elements. Collective for rank-local sources (files,
        ``dataset_fn``) that warn: each rank reads the rest of its share to count it, and one
        allreduce sums the counts (every rank ends the epoch at the same step)."""
        if self._source.global_position:
            here, total = self._source.dropped_here, self._source.dropped
        else:
            here = total = self._dropped
        if not self._source.global_position and self._dataset._warn_drops:
            if self._pipe is not None:
                try:
                    while (chunk := self._pipe.get()) is not None:
                        here += len(chunk)
                except Exception:
                    self._agree(0, "elements dropped", ReduceOp.SUM)  # join the others' count, then fail here
                    raise
            total = self._agree(here, "elements dropped", ReduceOp.SUM)
        self.close()
        self._done = True
        self._dataset._report_dropped(here, total, self._epoch)

    def _start(self) -> None:
        length = self._source.length(self._epoch, self._offset)
        if self._source.collective_length:
            agreed = self._agree(-1 if length is None else length, "dataset length")
            self._dropped = 0 if agreed < 0 else length - agreed
            length = None if agreed < 0 else agreed
        self._length = length
        self._converter = Converter(self._strategy.backend)
        chunks = self._source.chunks(self._epoch, self._offset, self._dataset.steps_per_transfer, length,
                                     self._seed)
        prepare = self._converter.prepare if self._converter.staging else None
        self._pipe = Prefetcher(chunks, prepare, self._dataset.prefetch)

    def _finish(self, chunk: Chunk) -> Chunk:
        """``chunk`` (prepared by the prefetch thread) with its leaves on the strategy's backend. Local."""
        return chunk.map_leaves(self._converter.finish) if self._converter.needs_finish(chunk) else chunk

    def _fill(self, count: int) -> list[tuple[Any, int]]:
        """``count`` steps without records, for an exact source whose records on this rank ran out. Local."""
        filler = self._source.filler(count)
        if self._converter.staging:
            filler = filler.map_leaves(self._converter.prepare)
        return self._finish(filler).steps()

    def _agree_steps(self, count: int) -> int:
        """Collective: the number of steps every rank takes next, this rank having ``count`` ready.

        The minimum over ranks for sources that drop, the maximum for exact
        ones. ``RuntimeError`` on every rank when some rank's pipeline failed,
        or when an exact source needs empty batches from a rank that has read
        no record (it does not know their shapes).
        """
        low, high, first_blind = self._exchange_steps(count)
        if low < 0:
            self.close()
            raise RuntimeError(
                f"rank {self._rank}: the input pipeline of rank {-1 - low} failed (epoch {self._epoch}, "
                f"offset {self._offset}); its error is raised there. Stopping here too, so no rank waits")
        if not self._source.exact:
            return low
        if high > 0 and first_blind < self._strategy.num_replicas_in_sync:
            self.close()
            raise RuntimeError(
                f"rank {self._rank}: rank {first_blind} read no record in epoch {self._epoch}, so it cannot "
                f"build the empty or padded batches of the last {high} step(s) that other ranks still have; "
                "give every rank at least one record (more files than ranks, no empty files), or pass "
                "shard_policy='element'")
        return high

    def _exchange_steps(self, count: int) -> tuple[int, int, int]:
        """Collective: one allreduce (MIN) of three int64: ``count``, ``-count`` and this rank if it cannot
        build empty batches (an exact source that has read no record), else N. Returns the minimum and the
        maximum of the counts, and the lowest such rank (N: none). ``count = -1 - rank`` says rank failed."""
        size = self._strategy.num_replicas_in_sync
        blind = self._rank if self._source.exact and not self._source.has_template else size
        if size == 1:
            return count, count, blind
        mins = self._strategy.communicator.allreduce(np.array([count, -count, blind], dtype=np.int64),
                                                     ReduceOp.MIN, name="data: steps ready")
        return int(mins[0]), -int(mins[1]), int(mins[2])

    def _agree(self, count: int, what: str, op: ReduceOp = ReduceOp.MIN) -> int:
        """Collective: the minimum (or ``op``) of ``count`` over all ranks (no communication at one rank)."""
        if self._strategy.num_replicas_in_sync == 1:
            return count
        result = self._strategy.communicator.allreduce(np.array(count, dtype=np.int64), op,
                                                       name=f"data: {what}")
        return int(result)

    def close(self) -> None:
        """Stop the prefetch thread and drop the steps it prepared. Local.

        The position stays: a later ``next()`` reads on from it (re-iterable
        datasets only: a one-shot iterator cannot start over).
        """
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        self._ready.clear()
        self._final = False

    def __repr__(self) -> str:
        return f"<DistributedIterator {self._source.kind} epoch {self._epoch} offset {self._offset}>"


def distribute_dataset(strategy: "MPIStrategy", dataset: Any, auto_shard: bool = True, *,
                       prefetch: Optional[int] = None,
                       steps_per_transfer: int = 1, shard_policy: str = "auto",
                       drop_remainder: Optional[bool] = None) -> DistributedDataset:
    """Distribute ``dataset`` over the strategy's replicas. Local.

    - Any iterable: with ``auto_shard`` rank ``r`` receives element
      ``s * N + r`` at step ``s``; without it every rank receives every
      element. Sequences (``len`` and indexing) are indexed directly, other
      iterables are read in full on every rank.
    - :class:`ArrayDataset`: each step's ``global_batch_size`` rows are
      split, ``global_batch_size / N`` per rank (``ValueError`` unless
      divisible); without ``auto_shard`` every rank reads the whole batch.
    - :class:`FileDataset`: by file (rank ``r`` reads files ``r, r + N, ...``)
      when there are at least ``N`` files, else by record;
      ``shard_policy`` (``"auto"``, ``"file"``, ``"element"``) forces one.
      The choice is in ``.shard_policy`` and logged once, at INFO level on
      rank 0, to the ``mpidist.data`` logger. With a ``global_batch_size``
      each rank gets ``global_batch_size / N`` records per step: whole
      batches of its own files (by file) or its rows of each global batch
      (by record). Such a dataset is exact with ``remainder="partial"`` or
      ``"mask"``: every rank runs the most steps any rank has, the ranks
      whose records ran out reading empty or all-padding batches; iterating
      it is collective (one small allreduce per chunk of steps).

    Args:
        prefetch: chunks prepared ahead in a background thread (0: prepare
            each step when ``next()`` asks for it). The thread hides the
            preparation behind your step when it has a core (or, on a GPU, a
            copy engine) to itself. Default: 2 on a GPU or when the rank has
            a spare core (its affinity cores divided among the ranks of its
            node), else 0, so that the default never slows training down.
        steps_per_transfer: steps gathered, copied to the device and agreed
            on together (pass ``iterations`` of :func:`run_steps_on_dataset`).
        drop_remainder: for element streams (any iterable, a ``FileDataset``
            without ``global_batch_size``): elements that would give some
            ranks more steps than others are dropped, so that every rank runs
            the same number of steps. By default each rank warns once
            (``UserWarning``) with how many were dropped in the epoch, on
            that rank and in total; ``True`` drops them silently. ``False``
            raises ``ValueError``: to see every element, read the data as an
            :class:`ArrayDataset` with ``remainder="partial"`` or ``"mask"``,
            or as a batched :class:`FileDataset`. Datasets with a global batch
            size choose with their own ``remainder`` (passing
            ``drop_remainder`` raises ``ValueError``).

    Every rank must pass the same dataset. Each ``iter()`` of the result
    starts over (a one-shot iterator, such as a generator, cannot: a second
    ``iter()`` raises ``RuntimeError``).
    """
    rank, size = strategy.rank, strategy.num_replicas_in_sync
    _check_drop_remainder(drop_remainder, dataset)
    if shard_policy not in SHARD_POLICIES:
        raise ValueError(f"shard_policy must be one of {', '.join(SHARD_POLICIES)}, got {shard_policy!r}")
    if isinstance(dataset, ArrayDataset):
        if auto_shard:
            per_replica_batch_size(dataset.global_batch_size, size, rank)
        source: Any = _ArraySource(dataset, rank, size, auto_shard)
        policy = "batch" if auto_shard else "off"
    else:
        _require_iterable(dataset, "distribute_dataset: dataset")
        policy = "element" if auto_shard else "off"
        if isinstance(dataset, FileDataset) and auto_shard:
            policy = choose_shard_policy(len(dataset.files), size, shard_policy)
            if rank == 0:
                logger.info("mpidist: %d files over %d ranks: sharding by %s%s", len(dataset.files), size, policy,
                            "" if policy == "file" else " (fewer files than ranks: every rank reads every file)")
        elif shard_policy != "auto" and auto_shard:
            raise ValueError(f"shard_policy={shard_policy!r} applies to a FileDataset; got a "
                             f"{type(dataset).__name__}, which is sharded by element")
        if isinstance(dataset, FileDataset) and (policy == "file" or dataset.global_batch_size is not None):
            source = _file_source(dataset, policy, rank, size)
        else:
            group, pick = (size, rank) if auto_shard else (1, 0)
            source = _StreamSource("elements", _epoch_stream(dataset), lambda: _length_of(dataset), group, pick, rank)
    return DistributedDataset(strategy, source, shard_policy=policy, prefetch=prefetch,
                              steps_per_transfer=steps_per_transfer, epoch=getattr(dataset, "epoch", 0),
                              drop_remainder=drop_remainder)


def _file_source(files: FileDataset, policy: str, rank: int, size: int) -> Any:
    """The source of a :class:`FileDataset` sharded by ``policy`` (``"file"``, ``"element"`` or ``"off"``).

    By file the stream is this rank's files, and the position rank-local;
    otherwise every rank reads every file. Batched, each step reads a whole
    per-replica batch by file, else a global batch split over the ranks (the
    whole of it without sharding).
    """
    stream = _file_shard_stream(files, rank, size) if policy == "file" else _epoch_stream(files)
    batch = files.global_batch_size
    if batch is None:
        return _StreamSource("files", stream, lambda: None, 1, 0, rank, global_position=False)
    per_rank = batch if policy == "off" else per_replica_batch_size(batch, size, rank)
    group, pick, parts = {"file": (per_rank, 0, 1), "element": (batch, rank, size), "off": (batch, 0, 1)}[policy]
    batches = RecordBatches(group, pick, parts, files.remainder, per_rank)
    kind = "file batches" if policy == "file" else "record batches"
    return _BatchSource(kind, stream, batches, batch, rank, global_position=policy != "file")


def _file_shard_stream(files: FileDataset, rank: int, size: int) -> Callable[[int], Iterable[Any]]:
    """The records of rank's files (:func:`file_shard`) in an epoch's file order."""
    def stream(epoch: int) -> Iterable[Any]:
        ordered = files.epoch_files(epoch)
        return files.read([ordered[i] for i in file_shard(len(files.files), rank, size)])

    return stream


def _check_drop_remainder(drop_remainder: Optional[bool], dataset: Any) -> None:
    if drop_remainder is None:
        return
    if isinstance(dataset, (ArrayDataset, FileDataset)) and getattr(dataset, "remainder", None) is not None:
        raise ValueError(f"drop_remainder applies to element streams; an {type(dataset).__name__} with a global "
                         f"batch size chooses with its own remainder= (now {dataset.remainder!r}): 'drop', "
                         "'partial' or 'mask'")
    if drop_remainder is False:
        raise ValueError("drop_remainder=False: an element stream keeps equal steps on every rank only by dropping "
                         "the elements past the last full step; to read every element use an ArrayDataset with "
                         "remainder='partial' or 'mask', or a FileDataset with a global_batch_size (or leave "
                         "drop_remainder at None to be warned)")


def distribute_datasets_from_function(strategy: "MPIStrategy", dataset_fn: Callable[[InputContext], Any], *,
                                      prefetch: Optional[int] = None, steps_per_transfer: int = 1,
                                      drop_remainder: Optional[bool] = None) -> DistributedDataset:
    """Call ``dataset_fn(InputContext)`` on each rank and iterate what it returns.

    The call is local, made once, here. Each step every rank takes the next
    element of its own iterable; iterating is collective: the first ``next()``
    of each iterator agrees on the length (MIN over ranks, one allreduce),
    and when some rank's iterable has no ``len()`` every chunk of steps is
    agreed on. An iterable that is its own iterator (a generator) is read
    only once (a second ``iter()`` raises ``RuntimeError``); return a
    re-iterable object (a list, an :class:`ArrayDataset`) to iterate several
    epochs. ``set_epoch`` reaches the iterable's own
    ``set_epoch``, if it has one. Elements past the shortest rank's last
    step are dropped, with a warning unless ``drop_remainder=True`` (see
    :func:`distribute_dataset`).
    """
    size, rank = strategy.num_replicas_in_sync, strategy.rank
    _check_drop_remainder(drop_remainder, None)
    data = dataset_fn(InputContext(size, rank, size))
    _require_iterable(data, f"rank {rank}: the value returned by dataset_fn")
    source = _StreamSource("function", _epoch_stream(data), lambda: _length_of(data), 1, 0, rank,
                           global_position=False, collective_length=True)
    return DistributedDataset(strategy, source, shard_policy="function", prefetch=prefetch,
                              steps_per_transfer=steps_per_transfer, epoch=getattr(data, "epoch", 0),
                              drop_remainder=drop_remainder)


# --------------------------------------------------------------------------
# Multi-step loops
# --------------------------------------------------------------------------


class MultiStepContext:
    """Outputs of the steps run by one :func:`run_steps_on_dataset` call.

    The step function records outputs with :meth:`set_last_step_output` and
    :meth:`set_non_tensor_output` (replica context, local); they are
    available once the call has returned.

    Attributes:
        last_step_outputs: ``name`` -> the value last recorded under ``name``,
            reduced across replicas with its ``reduce_op`` (a plain array,
            identical on every rank) or, without one, a nest of ``PerReplica``.
        non_tensor_outputs: ``name`` -> what was recorded, as it is (this rank's).
        steps_run: the steps run: fewer than ``iterations`` when the data ran
            out, the same number on every rank.
    """

    def __init__(self, strategy: "MPIStrategy") -> None:
        self._strategy = strategy
        self._outputs: dict[str, tuple[Any, Optional["AnyReduceOp"]]] = {}
        self.last_step_outputs: dict[str, Any] = {}
        self.non_tensor_outputs: dict[str, Any] = {}
        self.steps_run = 0

    def set_last_step_output(self, name: str, output: Any, reduce_op: Optional["AnyReduceOp"] = None) -> None:
        """Record ``output`` (a nest of arrays or numbers) under ``name``. Local.

        ``reduce_op`` is what ``strategy.reduce`` accepts (a ``ReduceOp``, a
        ``VariableAggregation`` or a name of either), checked here. Every
        rank must record the same names: they are reduced together after the
        last step.
        """
        if reduce_op is not None:
            self._strategy.extended.reduce_op(reduce_op)
        local = select_replica(None, output)
        self._outputs[name] = (local, reduce_op)

    def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Record any object under ``name`` in ``non_tensor_outputs``, unreduced. Local."""
        self.non_tensor_outputs[name] = output

    def _collect(self) -> None:
        """Collective when any output has a reduce op: reduce the outputs in name order."""
        for name in sorted(self._outputs):
            value, op = self._outputs[name]
            self.last_step_outputs[name] = (wrap(self._strategy.rank, value) if op is None
                                            else self._strategy.reduce(op, value))

    def __repr__(self) -> str:
        return (f"<MultiStepContext steps_run={self.steps_run} last_step_outputs={sorted(self._outputs)} "
                f"non_tensor_outputs={sorted(self.non_tensor_outputs)}>")


def run_steps_on_dataset(strategy: "MPIStrategy", fn: Callable[[MultiStepContext, Any], Any],
                         iterator: Iterator[Any], iterations: int) -> MultiStepContext:
    """Run ``fn(ctx, inputs)`` in replica context for up to ``iterations`` steps.

    ``inputs`` is the next element of ``iterator`` with ``PerReplica`` values
    unwrapped, as in ``strategy.run``. Stops early, on every rank alike, when
    the iterator is exhausted. Returns the :class:`MultiStepContext` ``ctx``.
    Collective: as collective as ``fn`` and ``next(iterator)``, plus one
    reduction per output recorded with a ``reduce_op``. To fetch the batches
    of all ``iterations`` steps in one transfer, distribute the dataset with
    ``steps_per_transfer=iterations``.
    """
    iterations = check_count("iterations", iterations, 1)
    if isinstance(iterator, DistributedDataset) or not hasattr(iterator, "__next__"):
        raise TypeError(f"run_steps_on_dataset needs an iterator, got {type(iterator).__name__}; pass "
                        "iter(distributed_dataset) and reuse it across calls")
    ctx = MultiStepContext(strategy)
    for _ in range(iterations):
        try:
            inputs = next(iterator)
        except StopIteration:
            break
        strategy.run(fn, args=(ctx, inputs))
        ctx.steps_run += 1
    ctx._collect()
    return ctx
