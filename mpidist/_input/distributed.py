"""Distributed datasets and their iterators: every rank takes one step of its input per ``next()``.

A :class:`DistributedDataset` holds a source (:mod:`mpidist._input.sources`)
and the :class:`InputHost` it distributes over (rank, number of replicas,
backend, communicator: what :class:`~mpidist.MPIStrategy` provides). Its
:class:`DistributedIterator` reads the source in chunks of
``steps_per_transfer`` steps through a :class:`~mpidist._input.prefetch.Prefetcher`.
When a rank cannot know the number of steps alone, the ranks agree on each
chunk, in one small allreduce, how many steps they all take and whether
every rank's input succeeded; only when some rank's failed does
``Communicator.outcome`` gather what failed (the failed ranks raise their
errors and the others a ``RuntimeError`` naming them). When an epoch's
sources open, one small allreduce asks whether every rank opened its source
and whether the ranks agree on what fixes the epoch's order (length, batch
size, shuffle, seed, epoch, position: :mod:`mpidist._input.order`); for an
``ArrayDataset``, whose steps every rank knows, it is the epoch's only
collective. Sources that count the elements they drop ask once more whether
every rank succeeded (``outcome``) when they have counted them. The
iterator's position (``get_state()``) keeps the format ``"mpidist.data/1"``.
This module never calls MPI itself.
"""

from __future__ import annotations

import collections
import inspect
import os
import warnings
from typing import Any, NoReturn, Optional, Protocol

import numpy as np

from mpidist._comm.backend import Backend
from mpidist._comm.communicator import Communicator, describe_failures
from mpidist._comm.reduce_op import ReduceOp
from mpidist._comm.timeline import Timeline
from mpidist._errors import CollectiveMismatchError, on_rank
from mpidist._input.datasets import Chunk
from mpidist._input.order import (
    decode_fields,
    describe_order,
    encode_fields,
    order_agreed,
    order_differences,
    order_record,
)
from mpidist._input.prefetch import Converter, Prefetcher, default_depth, wrap
from mpidist._input.sharding import check_count

__all__ = ["STATE_FORMAT", "DistributedDataset", "DistributedIterator", "InputHost"]

STATE_FORMAT = "mpidist.data/1"

# Where mpidist's private modules live: a warning skips their frames to point at the user's code.
_PRIVATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_")


class InputHost(Protocol):
    """What the input layer needs of the strategy it distributes data over (:class:`~mpidist.MPIStrategy`)."""

    @property
    def rank(self) -> int:
        """This rank's replica id."""

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas: the communicator's size."""

    @property
    def backend(self) -> Backend:
        """Where this rank's arrays live: the elements arrive there."""

    @property
    def communicator(self) -> Communicator:
        """The communicator of the iterators' collectives."""


class DistributedDataset:
    """A dataset whose ``iter()`` gives each rank its share of every step.

    Created by :func:`~mpidist._input.factories.distribute_dataset` or
    :func:`~mpidist._input.factories.distribute_datasets_from_function`. Each
    ``iter()`` starts the current epoch over (:meth:`set_epoch`). Creating
    iterators is local; iterating is collective where the number of steps is
    not known in advance, and when an ``ArrayDataset``'s epoch starts (see
    :mod:`mpidist._input.distributed`).

    Attributes:
        shard_policy: how the data is shared out: ``"batch"`` (array rows of
            each global batch), ``"element"``, ``"file"``, ``"function"``
            (your ``dataset_fn``) or ``"off"`` (every rank reads everything).
        prefetch: chunks prepared ahead in a background thread (0: none; chosen by
            :func:`~mpidist._input.prefetch.default_depth` unless given).
        steps_per_transfer: steps per chunk: gathered, copied to the device and agreed on together.
    """

    def __init__(
        self,
        host: InputHost,
        source: Any,  # a source of sources.py; duck-typed: only exact ones have filler and has_template
        *,
        shard_policy: str,
        prefetch: Optional[int],
        steps_per_transfer: int,
        epoch: int,
        drop_remainder: Optional[bool] = None,
    ) -> None:
        self._host, self._source = host, source
        self.shard_policy = shard_policy
        self._warn_drops = source.warn_drops and not drop_remainder
        communicator = host.communicator
        self.prefetch = (
            default_depth(communicator.backend, communicator.local_size, getattr(source, "views", False))
            if prefetch is None
            else check_count("prefetch", prefetch)
        )
        self.steps_per_transfer = check_count("steps_per_transfer", steps_per_transfer, 1)
        self._epoch = check_count("epoch", epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` reads."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` (its shuffle order) from the next ``iter()`` on. Local; call it on every rank
        (an ``ArrayDataset``'s or ``FileDataset``'s epoch is compared at its first ``next()``)."""
        self._epoch = check_count("epoch", epoch)

    def __iter__(self) -> DistributedIterator:
        timeline = self._host.communicator.timeline
        return DistributedIterator(self) if timeline is None else _RecordedIterator(self, timeline)

    def __len__(self) -> int:
        """Steps of a whole epoch, when every rank knows it without communication."""
        steps = None if self._source.collective_length else self._source.length(self._epoch, 0)
        if steps is None:
            raise TypeError(
                f"the number of steps of this {self.shard_policy}-sharded dataset is only known by "
                "iterating it (its dataset has no len(), or ranks read different data)"
            )
        return steps

    def _report_dropped(self, here: int, total: int, epoch: int) -> None:
        """Warn, once per dataset, that ``total`` elements (``here`` of them this rank's) were dropped. Local."""
        if total > 0 and self._warn_drops:
            self._warn_drops = False
            warnings.warn(
                on_rank(
                    self._host.rank,
                    f"mpidist dropped {total} element(s) of epoch {epoch} ({here} on this "
                    f"rank) so that all {self._host.num_replicas_in_sync} ranks run the same number of steps "
                    f"({self.shard_policy} sharding). Pass drop_remainder=True to drop them without this warning; to "
                    "see every element, read the data as an ArrayDataset with remainder='partial' or 'mask', or as a "
                    "FileDataset with a global_batch_size",
                ),
                UserWarning,
                stacklevel=_callers_level(),
            )

    def iterator_from_state(self, state: dict[str, Any]) -> DistributedIterator:
        """A new iterator positioned at ``state`` (from :meth:`DistributedIterator.get_state`). Local."""
        iterator = iter(self)
        iterator.set_state(state)
        return iterator

    def __repr__(self) -> str:
        return (
            f"<DistributedDataset {self.shard_policy}-sharded over {self._host.num_replicas_in_sync} "
            f"replicas, epoch {self._epoch}, prefetch {self.prefetch}>"
        )


class DistributedIterator:
    """Iterator over a :class:`DistributedDataset`: each ``next()`` is one step.

    ``next()`` returns this rank's element as a nest of ``PerReplica``. It is
    collective (one allreduce per chunk of ``steps_per_transfer`` steps, which
    also says whether every rank's input succeeded) when the number of steps is
    not known in advance; for a ``dataset_fn``-built dataset the first
    ``next()`` agrees on the length (one allreduce); in both cases, and for an
    ``ArrayDataset``, the first ``next()`` (after ``iter()``, :meth:`close` or
    :meth:`set_state`) also checks that every rank opened its source and that
    the ranks agree on what fixes the order (one more, :meth:`_check_start`).
    Otherwise it is local. Every rank must call it the same number of times.
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset, self._source, self._host = dataset, dataset._source, dataset._host
        self._rank = self._host.rank
        self._epoch, self._offset, self._seed = dataset.epoch, 0, self._source.seed
        self._prefetcher: Optional[Prefetcher] = None
        self._converter: Optional[Converter] = None
        self._reset()

    def _reset(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._prefetcher = None
        self._converter = None
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
        ``global_batch_size``, ``shuffle``, ``remainder``; for a
        ``FileDataset``, ``files`` and ``shuffle`` (``seed`` is its seed), and
        for a batched one ``global_batch_size`` and ``remainder``. Steps prefetched
        but not yet returned by ``next()`` do not count.
        """
        state = {
            "format": STATE_FORMAT,
            "kind": self._source.kind,
            "epoch": self._epoch,
            "offset": self._offset,
            "seed": self._seed,
            "num_replicas": self._host.num_replicas_in_sync,
        }
        state.update(self._source.state())
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`get_state` dict, possibly from another number of ranks). Local.

        The epoch, offset and shuffle seed are taken from ``state`` (a
        ``FileDataset``'s seed must be its own). Raises ``ValueError`` when
        the state belongs to another kind of dataset, to different data, or
        to the same data read in another order.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                on_rank(
                    self._rank,
                    f"not an mpidist iterator state (expected a dict with format {STATE_FORMAT!r}), got {state!r}",
                )
            )
        if state.get("kind") != self._source.kind:
            raise ValueError(
                on_rank(
                    self._rank,
                    f"the state is of a {state.get('kind')!r} iterator, but this "
                    f"iterator reads a {self._source.kind!r} source",
                )
            )
        for key in ("epoch", "offset", "seed"):
            check_count(f"state[{key!r}]", state.get(key))
        self._source.check(state, self._host.num_replicas_in_sync)
        self._reset()
        self._epoch, self._offset = check_count("epoch", state["epoch"]), state["offset"]
        self._seed = check_count("seed", state["seed"])

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if not self._ready:
            self._refill()
        element, advance = self._ready.popleft()
        self._offset += advance
        self._host.communicator.count_input_step()
        return wrap(self._rank, element)

    def _refill(self) -> None:
        if self._done:
            raise StopIteration
        prefetcher, converter = self._prefetcher, self._converter
        if prefetcher is None or converter is None:
            prefetcher, converter = self._start()
        if not self._final:
            if self._length is None:
                self._ready.extend(self._agreed_steps(prefetcher, converter))
            else:
                chunk = prefetcher.get()
                self._final = chunk is None
                self._ready.extend([] if chunk is None else _finish(converter, chunk).steps())
        if not self._ready:
            self._end_epoch()
            raise StopIteration

    def _agreed_steps(self, prefetcher: Prefetcher, converter: Converter) -> list[tuple[Any, int]]:
        """Collective: the next chunk's steps, as many as the ranks agree on (:meth:`_agree_steps`).

        Everything that can fail on one rank only (reading the chunk, moving
        it to the device, building the steps without records that an exact
        source may need if other ranks have more) happens before the
        agreement, whose allreduce says whether it failed anywhere.
        """
        steps: list[tuple[Any, int]] = []
        padding: list[tuple[Any, int]] = []
        error: Optional[BaseException] = None
        try:
            chunk = prefetcher.get()
            if chunk is not None:
                steps = _finish(converter, chunk).steps()
            short = self._dataset.steps_per_transfer - len(steps)
            if short and self._source.exact and self._source.has_template:
                padding = self._fill(converter, short)
        except BaseException as caught:  # an interrupt too (from the source): the others hear of it, then it is raised
            error = caught
        count = self._agree_steps(len(steps), error)
        self._final = count < self._dataset.steps_per_transfer
        self._dropped += max(len(steps) - count, 0)
        return (steps + padding)[:count]

    def _check_input(self, error: Optional[BaseException], what: str, doing: str) -> None:
        """Collective: did every rank's input succeed (``Communicator.outcome``)?

        ``error`` is this rank's failure (``None``: none). If some rank
        failed, every rank closes the iterator (the position stays) and
        raises: a failed rank its own ``error``, every other rank a
        ``RuntimeError`` naming the failed ranks, what failed, the epoch and
        ``doing``, so that no rank waits for them in a later collective.
        """
        failures = self._host.communicator.outcome(error, f"data: {what}")
        if not failures:
            return
        self.close()
        if error is not None:
            raise error
        raise RuntimeError(
            on_rank(
                self._rank,
                f"the input pipeline failed elsewhere in epoch {self._epoch} (offset {self._offset}, "
                f"{doing}): {describe_failures(failures)}. Each of those ranks raises its own error; "
                "stopping here too, so that no rank waits",
            )
        )

    def _end_epoch(self) -> None:
        """Close, then warn about dropped elements. Collective for rank-local sources (files,
        ``dataset_fn``) that warn: each rank reads the rest of its share to count it, the ranks
        check that every rank could (:meth:`_check_input`), and one allreduce sums the counts
        (every rank ends the epoch at the same step)."""
        if self._source.global_position:
            here, total = self._source.dropped_here, self._source.dropped
        else:
            here = total = self._dropped
        if not self._source.global_position and self._dataset._warn_drops:
            error: Optional[BaseException] = None
            if self._prefetcher is not None:
                try:
                    while (chunk := self._prefetcher.get()) is not None:
                        here += len(chunk)
                except BaseException as caught:
                    error = caught
            self._check_input(error, "rest counted", "counting the elements past the last step")
            total = self._agree(here, "elements dropped", ReduceOp.SUM)
        self.close()
        self._done = True
        self._dataset._report_dropped(here, total, self._epoch)

    def _start(self) -> tuple[Prefetcher, Converter]:
        """Open the epoch's source at the position.

        Collective when the ranks agree on this epoch's steps (a
        ``dataset_fn``'s data, whose lengths differ between ranks; a source
        whose length is unknown, agreed on chunk by chunk) or on its order
        (an ``ArrayDataset``, unless ``check_collectives`` is off): a
        ``dataset_fn``'s length (one allreduce, MIN), then whether every rank
        opened its source and what fixes the order (:meth:`_check_start`, one
        allreduce). A rank that could not give its length (a ``dataset_fn``'s,
        or an ``ArrayDataset``'s) joins the length agreement as "unknown" and
        raises with the others at the check. Local otherwise.
        """
        error: Optional[BaseException] = None
        source = self._source
        options = self._host.communicator.options
        checked = source.collective_length or (source.agrees_order and options.check_collectives)
        try:
            length = source.length(self._epoch, self._offset)
        except BaseException as caught:  # a dataset_fn's own failure too (see distribute_datasets_from_function)
            if not checked:
                raise
            length, error = None, caught  # raised at the check, with the others
        if source.collective_length:
            agreed = self._agree(-1 if length is None else length, "dataset length")
            self._dropped = 0 if agreed < 0 else length - agreed
            length = None if agreed < 0 else agreed
        self._length = length
        converter = self._converter = Converter(self._host.backend)
        if error is None:
            try:
                chunks = source.chunks(self._epoch, self._offset, self._dataset.steps_per_transfer, length, self._seed)
            except BaseException as caught:
                error = caught
        if checked or length is None:
            self._check_start(error)
        if error is not None:  # at one rank, or not checked: every rank knows the length, none waits for this one
            raise error
        prepare = converter.prepare if converter.staging else None
        prefetcher = self._prefetcher = Prefetcher(chunks, prepare, self._dataset.prefetch)
        return prefetcher, converter

    def _check_start(self, error: Optional[BaseException]) -> None:
        """Collective (nothing at one rank): did every rank open its source, and do the ranks agree on what
        fixes the epoch's order (:meth:`_order`)?

        One allreduce (SUM) of this rank's record (:func:`order_record`):
        whether it failed (``error``, its failure to open the source, or
        ``None``), and hash words of its order (none with
        ``check_collectives`` off). If some rank failed, every rank raises
        through :meth:`_check_input`; if the orders differ,
        :meth:`_disagree` raises on every rank. Only then a second exchange.
        """
        size = self._host.num_replicas_in_sync
        if size == 1:
            return
        communicator = self._host.communicator
        fields = self._order() if communicator.options.check_collectives else {}
        record = order_record(fields, error is not None, size)
        sums = communicator.allreduce(record, ReduceOp.SUM, name="data: epoch start")
        if sums[0]:
            self._check_input(error, "source opened", "opening its source")
        if not order_agreed(sums, record, size):
            self._disagree(fields)

    def _order(self) -> dict[str, Any]:
        """What fixes this epoch's order, as the ranks agree on it: the kind of source and its sharding,
        the epoch, the source's state (an ``ArrayDataset``'s length, batch size, shuffle, remainder; a batched
        ``FileDataset``'s batch size and remainder) and fields (the seed; a ``FileDataset``'s number of files
        and shuffle), the position where it is global, and the steps per chunk where the ranks agree on
        their steps chunk by chunk. Local."""
        source = self._source
        fields: dict[str, Any] = {
            "dataset": source.kind,
            "sharding": self._dataset.shard_policy,
            "epoch": self._epoch,
            **source.state(),
            **source.order(self._seed),
        }
        if source.global_position:
            fields["offset"] = int(self._offset)
        if self._length is None:
            fields["steps_per_transfer"] = self._dataset.steps_per_transfer
        return fields

    def _disagree(self, fields: dict[str, Any]) -> NoReturn:
        """Collective, once the ranks know that their orders differ: every rank's ``fields``, then
        :class:`~mpidist.CollectiveMismatchError` naming what differs, each rank's value and the ranks.

        The iterator is closed at its position, which stays.
        """
        texts = self._host.communicator.allgather_bytes(encode_fields(fields), name="data: epoch start (order)")
        per_rank = [decode_fields(text) for text in texts]
        self.close()
        raise CollectiveMismatchError(
            on_rank(
                self._rank,
                f"the ranks would read this {self._source.kind!r} dataset in different orders: "
                f"{order_differences(per_rank)}. Every rank must distribute the same dataset (the same length, "
                "global batch size, shuffle and seed), read the same epoch (call set_epoch on every rank) and "
                "start from the same position; no step was read, and the iterator stays at its position",
            ),
            {r: describe_order(f) for r, f in enumerate(per_rank)},
        )

    def _fill(self, converter: Converter, count: int) -> list[tuple[Any, int]]:
        """``count`` steps without records, for an exact source whose records on this rank may run out
        before the others'. Local."""
        filler = self._source.filler(count)
        if converter.staging:
            filler = filler.map_leaves(converter.prepare)
        return _finish(converter, filler).steps()

    def _agree_steps(self, count: int, error: Optional[BaseException]) -> int:
        """Collective: the number of steps every rank takes next, this rank having ``count`` ready.

        The minimum over ranks for sources that drop, the maximum for exact
        ones. One allreduce (MIN) of four int64: ``count``, ``-count``, this
        rank if it cannot build empty batches (an exact source that has read
        no record), else N, and ``-1`` if this rank's input failed
        (``error``), else 0. If some rank's failed, every rank raises through
        :meth:`_check_input` (only then a second collective, to say what
        failed). ``RuntimeError`` on every rank when an exact source needs
        empty batches from a rank that has read no record (it does not know
        their shapes); the lowest such rank is named.
        """
        size = self._host.num_replicas_in_sync
        blind = self._rank if self._source.exact and not self._source.has_template else size
        mins = self._host.communicator.allreduce(
            np.array([count, -count, blind, 0 if error is None else -1], dtype=np.int64),
            ReduceOp.MIN,
            name="data: steps ready",
        )
        if mins[3] < 0:
            self._check_input(error, "input ready", "reading")
        low, high, first_blind = int(mins[0]), -int(mins[1]), int(mins[2])
        if not self._source.exact:
            return low
        if high > 0 and first_blind < size:
            self.close()
            raise RuntimeError(
                on_rank(
                    self._rank,
                    f"no record was read on rank {first_blind} in epoch {self._epoch}, so it cannot "
                    f"build the empty or padded batches of the last {high} step(s) that other ranks still have; "
                    "give every rank at least one record (more files than ranks, no empty files), or pass "
                    "shard_policy='element'",
                )
            )
        return high

    def _agree(self, count: int, what: str, op: ReduceOp = ReduceOp.MIN) -> int:
        """Collective: the minimum (or ``op``) of ``count`` over all ranks."""
        result = self._host.communicator.allreduce(np.array(count, dtype=np.int64), op, name=f"data: {what}")
        return int(result)

    def close(self) -> None:
        """Stop the prefetch thread and drop the steps it prepared. Local.

        The position stays: a later ``next()`` reads on from it (re-iterable
        datasets only: a one-shot iterator cannot start over).
        """
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._ready.clear()
        self._final = False

    def __repr__(self) -> str:
        return f"<DistributedIterator {self._source.kind} epoch {self._epoch} offset {self._offset}>"


class _RecordedIterator(DistributedIterator):
    """A :class:`DistributedIterator` whose steps are events of the communicator's timeline (``options.timeline``)."""

    def __init__(self, dataset: DistributedDataset, timeline: Timeline) -> None:
        super().__init__(dataset)
        self._next = timeline.timed(super().__next__, "input")

    def __next__(self) -> Any:
        return self._next()


def _finish(converter: Converter, chunk: Chunk) -> Chunk:
    """``chunk`` (prepared by the prefetch thread) with its leaves on the converter's backend. Local."""
    return chunk.map_leaves(converter.finish) if converter.needs_finish(chunk) else chunk


def _callers_level() -> int:
    """Local: the ``stacklevel`` at which a warning issued by this function's caller names the
    innermost frame outside mpidist's private modules (the user's loop, also through
    ``run_steps_on_dataset``)."""
    here = inspect.currentframe()
    level, frame = 1, here.f_back if here is not None else None  # the caller: stacklevel 1
    while frame is not None and frame.f_back is not None and frame.f_code.co_filename.startswith(_PRIVATE):
        level, frame = level + 1, frame.f_back
    return level
