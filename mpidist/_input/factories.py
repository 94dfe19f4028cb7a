"""Factories of distributed datasets: which source, sharded how, for what the user passes.

One rank is one replica, so a dataset is distributed by giving each rank its
share of every step:

- :func:`distribute_dataset` over any iterable: at step ``s`` rank ``r``
  receives element ``s * N + r`` (``auto_shard=True``) or every element
  (``auto_shard=False``). Over an :class:`~mpidist._input.datasets.ArrayDataset`
  (arrays with a common first dimension and a *global* batch size ``B``) each
  step's ``B`` rows are split into ``B / N`` rows per rank, shuffled by
  ``(seed, epoch)`` without communication. Over a
  :class:`~mpidist._input.datasets.FileDataset` the files are shared out by
  file when there are at least ``N`` of them, else the records are; with a
  ``global_batch_size`` its records are stacked into batches.
- :func:`distribute_datasets_from_function` calls your function with an
  :class:`~mpidist._input.datasets.InputContext` on every rank and iterates
  what it returns.

Both return a :class:`~mpidist._input.distributed.DistributedDataset`;
:mod:`mpidist._input.distributed` says when iterating it is collective.
Elements arrive as nests of :class:`~mpidist.PerReplica` holding arrays of
the host's array module (NumPy, or CuPy on the rank's GPU); numbers become
0-d arrays, other leaves (strings, ...) are passed as they are. A background
thread prepares the next ``prefetch`` chunks (:mod:`mpidist._input.prefetch`);
on a GPU it also starts their copy to the device on a side CUDA stream. The
thread never talks to other ranks; it runs your iterable's code.

For array datasets and element sharding an iterator's position is global
(the number of samples consumed in the epoch, whatever the number of ranks),
so a checkpoint taken at N ranks resumes at M ranks with exactly the samples
not yet seen. Creating a distributed dataset is local.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NoReturn, Optional

from mpidist._errors import on_rank
from mpidist._input.datasets import ArrayDataset, FileDataset, InputContext
from mpidist._input.distributed import DistributedDataset, InputHost
from mpidist._input.sharding import SHARD_POLICIES, choose_shard_policy, per_replica_batch_size
from mpidist._input.sources import ArraySource, StreamSource, epoch_stream, file_fields, file_source

__all__ = ["distribute_dataset", "distribute_datasets_from_function"]

logger = logging.getLogger("mpidist.data")


def distribute_dataset(
    host: InputHost,
    dataset: Any,
    auto_shard: bool = True,
    *,
    prefetch: Optional[int] = None,
    steps_per_transfer: int = 1,
    shard_policy: str = "auto",
    drop_remainder: Optional[bool] = None,
) -> DistributedDataset:
    """Distribute ``dataset`` over the host's replicas. Local.

    - Any iterable: with ``auto_shard`` rank ``r`` receives element
      ``s * N + r`` at step ``s``; without it every rank receives every
      element. Sequences (``len`` and indexing) are indexed directly, other
      iterables are read in full on every rank.
    - :class:`ArrayDataset`: each step's ``global_batch_size`` rows are
      split, ``global_batch_size / N`` per rank (``ValueError`` unless
      divisible); without ``auto_shard`` every rank reads the whole batch.
      Iterating is local but for the first ``next()`` of each epoch, which
      checks that the ranks agree on its order (one small allreduce).
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
      it is collective (a check and one small allreduce per chunk of steps).

    Args:
        host: the strategy (:class:`~mpidist._input.distributed.InputHost`).
        prefetch: chunks prepared ahead in a background thread (0: prepare
            each step when ``next()`` asks for it). The thread hides the
            preparation behind your step when it has a core (or, on a GPU, a
            copy engine) to itself. Default: 2 on a GPU or when the rank has
            a spare core (its affinity cores divided among the ranks of its
            node), else 0, so that the default never slows training down.
        steps_per_transfer: steps per chunk: gathered, copied to the device
            and agreed on together (pass ``iterations`` of
            :func:`~mpidist._input.multistep.run_steps_on_dataset`).
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

    Every rank must pass the same dataset: an ``ArrayDataset``'s or a
    ``FileDataset``'s length, batch size, shuffle, seed and epoch are
    compared when each epoch starts (``CollectiveMismatchError`` on every
    rank when they differ); an arbitrary iterable's elements cannot be, only
    its end. Each ``iter()`` of the result starts over (a one-shot iterator,
    such as a generator, cannot: a second ``iter()`` raises ``RuntimeError``).
    """
    rank, size = host.rank, host.num_replicas_in_sync
    _check_drop_remainder(drop_remainder, dataset)
    if shard_policy not in SHARD_POLICIES:
        raise ValueError(f"shard_policy must be one of {', '.join(SHARD_POLICIES)}, got {shard_policy!r}")
    if isinstance(dataset, ArrayDataset):
        if auto_shard:
            per_replica_batch_size(dataset.global_batch_size, size, rank)
        source: Any = ArraySource(dataset, rank, size, auto_shard)
        policy = "batch" if auto_shard else "off"
    else:
        _require_iterable(dataset, "distribute_dataset: dataset")
        policy = "element" if auto_shard else "off"
        if isinstance(dataset, FileDataset) and auto_shard:
            policy = choose_shard_policy(len(dataset.files), size, shard_policy)
            if rank == 0:
                everyone = "" if policy == "file" else " (fewer files than ranks: every rank reads every file)"
                logger.info(
                    on_rank(None, "%d files over %d ranks: sharding by %s%s"),
                    len(dataset.files),
                    size,
                    policy,
                    everyone,
                )
        elif shard_policy != "auto" and auto_shard:
            raise ValueError(
                f"shard_policy={shard_policy!r} applies to a FileDataset; got a "
                f"{type(dataset).__name__}, which is sharded by element"
            )
        if isinstance(dataset, FileDataset) and (policy == "file" or dataset.global_batch_size is not None):
            source = file_source(dataset, policy, rank, size)
        else:
            group, pick = (size, rank) if auto_shard else (1, 0)
            # a FileDataset read by record: its number of files, shuffle and seed fix the order the ranks agree on
            fields = functools.partial(file_fields, dataset) if isinstance(dataset, FileDataset) else dict
            source = StreamSource(
                "elements", epoch_stream(dataset), lambda: _length_of(dataset), group, pick, rank, fields=fields
            )
    return DistributedDataset(
        host,
        source,
        shard_policy=policy,
        prefetch=prefetch,
        steps_per_transfer=steps_per_transfer,
        epoch=getattr(dataset, "epoch", 0),
        drop_remainder=drop_remainder,
    )


def distribute_datasets_from_function(
    host: InputHost,
    dataset_fn: Callable[[InputContext], Any],
    *,
    prefetch: Optional[int] = None,
    steps_per_transfer: int = 1,
    drop_remainder: Optional[bool] = None,
) -> DistributedDataset:
    """Call ``dataset_fn(InputContext)`` on each rank and iterate what it returns.

    The call is local, made once, here. If it raises (or returns something
    that is not iterable), the error is kept: each iterator of the dataset
    raises it when it starts, on this rank, while the other ranks raise a
    ``RuntimeError`` naming this one instead of waiting for it. Each step
    every rank takes the next element of its own iterable; iterating is
    collective: the first ``next()`` of each iterator agrees on the length
    (MIN over ranks, one allreduce) and checks that every rank opened its
    iterable (one more), and when some rank's iterable has no ``len()``
    every chunk of steps is agreed on. An iterable that is its own iterator
    (a generator) is read only once (a second ``iter()`` raises ``RuntimeError``); return a
    re-iterable object (a list, an :class:`ArrayDataset`) to iterate several
    epochs. ``set_epoch`` reaches the iterable's own
    ``set_epoch``, if it has one. Elements past the shortest rank's last
    step are dropped, with a warning unless ``drop_remainder=True`` (see
    :func:`distribute_dataset`).
    """
    size, rank = host.num_replicas_in_sync, host.rank
    _check_drop_remainder(drop_remainder, None)
    data: Any = None
    try:
        data = dataset_fn(InputContext(size, rank, size))
        _require_iterable(data, on_rank(rank, "the value returned by dataset_fn"))
        stream, length = epoch_stream(data), lambda: _length_of(data)
    except Exception as error:  # only this rank knows: raised where the ranks agree on the length
        stream = length = _raising(error)
    source = StreamSource(
        "function",
        stream,
        length,
        1,
        0,
        rank,
        global_position=False,
        collective_length=True,
    )
    return DistributedDataset(
        host,
        source,
        shard_policy="function",
        prefetch=prefetch,
        steps_per_transfer=steps_per_transfer,
        epoch=getattr(data, "epoch", 0),
        drop_remainder=drop_remainder,
    )


def _check_drop_remainder(drop_remainder: Optional[bool], dataset: Any) -> None:
    if drop_remainder is None:
        return
    if isinstance(dataset, (ArrayDataset, FileDataset)) and getattr(dataset, "remainder", None) is not None:
        raise ValueError(
            f"drop_remainder applies to element streams; an {type(dataset).__name__} with a global "
            f"batch size chooses with its own remainder= (now {dataset.remainder!r}): 'drop', "
            "'partial' or 'mask'"
        )
    if drop_remainder is False:
        raise ValueError(
            "drop_remainder=False: an element stream keeps equal steps on every rank only by dropping "
            "the elements past the last full step; to read every element use an ArrayDataset with "
            "remainder='partial' or 'mask', or a FileDataset with a global_batch_size (or leave "
            "drop_remainder at None to be warned)"
        )


def _require_iterable(data: Any, what: str) -> None:
    try:
        iter(data)
    except TypeError:
        raise TypeError(
            f"{what} must be iterable (a list, generator, ArrayDataset, FileDataset, ...), got {type(data).__name__}"
        ) from None


def _raising(error: Exception) -> Callable[..., NoReturn]:
    """A function that raises ``error``, whatever it is called with."""

    def fail(*_: Any) -> NoReturn:
        raise error

    return fail


def _length_of(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:
        return None
