"""Prefetch for the input pipeline: chunks of steps prepared in a background thread.

A :class:`Prefetcher` runs a generator of chunks (several steps of one
rank's input, :class:`~mpidist._input.datasets.Chunk`) up to ``depth`` chunks
ahead of the consumer. A :class:`Converter` moves their leaves to the
strategy's backend: on a GPU, ``prepare`` (in the thread) starts the copy to
the device on a side CUDA stream and ``finish`` (in the consumer) makes the
consumer's stream wait for it; on the host, numbers become 0-d arrays and
arrays stay as they are.

Everything here is local: the thread runs the source's code and never talks
to other ranks.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import numpy as np

from mpidist._comm.backend import Backend, DeviceStager
from mpidist._input.datasets import Chunk
from mpidist._values.nest import is_number, map_structure
from mpidist._values.values import PerReplica

__all__ = ["Converter", "Prefetcher", "wrap"]


class Converter:
    """Moves leaves to the strategy's backend: ``prepare`` in the producer, ``finish`` in the consumer.

    Create it in the consumer's thread: on a GPU it captures that thread's
    current CUDA stream as the one that will use the data. Local.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._stager = DeviceStager(backend) if backend.is_gpu else None

    @property
    def staging(self) -> bool:
        """Whether ``prepare`` does anything: it starts device copies on a GPU."""
        return self._stager is not None

    def needs_finish(self, chunk: Chunk) -> bool:
        """Whether ``finish`` changes anything: on the host, arrays of array batches stay as they are."""
        return self._stager is not None or chunk.elements is not None

    def prepare(self, leaf: Any) -> Any:
        """Producer side: start a host array's (or number's) copy to the device; other leaves pass."""
        if self._stager is not None and (isinstance(leaf, np.ndarray) or is_number(leaf)):
            return _Staged(self._stager.start(np.asarray(leaf)))
        return leaf

    def finish(self, leaf: Any) -> Any:
        """Consumer side: the device array of a started copy (the current stream waits for it)."""
        if isinstance(leaf, _Staged) and self._stager is not None:  # only a stager stages
            return self._stager.finish(leaf.token)
        if is_number(leaf):
            return self._backend.asarray(leaf)
        return leaf


def wrap(rank: int, element: Any) -> Any:
    """``element`` with every leaf wrapped as ``PerReplica({rank: leaf})``."""
    return map_structure(lambda x: PerReplica({rank: x}), element)


class _Staged:
    __slots__ = ("token",)

    def __init__(self, token: tuple[Any, Any]) -> None:  # from DeviceStager.start
        self.token = token


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _acquire(slots: queue.SimpleQueue[None], stop: threading.Event) -> bool:
    """Wait for a free prefetch slot; ``False`` once the consumer has stopped."""
    while not stop.is_set():
        try:
            slots.get(timeout=0.05)
            return True
        except queue.Empty:
            pass
    return False


_Item = Union[Chunk, _Failure, None]  # what the thread hands over: a prepared chunk, the source's error, or the end


def _produce(
    chunks: Iterator[Chunk],
    prepare: Optional[Callable[[Any], Any]],
    items: queue.SimpleQueue[_Item],
    slots: queue.SimpleQueue[None],
    stop: threading.Event,
) -> None:
    """Prefetch thread: prepare a chunk per free slot until the source ends, fails, or the consumer stops."""
    try:
        while _acquire(slots, stop):
            chunk = next(chunks, None)
            if chunk is None:
                items.put(None)
                return
            items.put(chunk if prepare is None else chunk.map_leaves(prepare))
    except BaseException as error:  # handed to the consumer, which re-raises it
        items.put(_Failure(error))


def default_depth(backend: Backend, ranks_on_node: int, views: bool = False) -> int:
    """Local: how many chunks to prepare ahead when the user does not say.

    2 when batches go to a GPU (their copies overlap the step on a side
    stream) or when the rank has a core of its own to spare (the cores of its
    affinity mask divided among the ranks of its node: with ``--bind-to none``
    every rank sees every core); else 0, since a thread that competes with the
    step for its only core (and for the GIL) slows training down. Also 0 on
    the host when the batches are ``views`` of the user's arrays: there is
    nothing to prepare, and the hand-off between threads would only add to
    each step.
    """
    if backend.is_gpu:
        return 2
    if views:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 2 if cores // max(1, ranks_on_node) >= 2 else 0


class Prefetcher:
    """Runs a chunk generator up to ``depth`` chunks ahead in a thread (``depth=0``: inline). Local.

    The hand-off uses two C-level ``SimpleQueue``: prepared chunks one way,
    free slots the other.
    """

    def __init__(self, chunks: Iterator[Chunk], prepare: Optional[Callable[[Any], Any]], depth: int) -> None:
        self._chunks, self._prepare, self._ended = chunks, prepare, False
        self._thread: Optional[threading.Thread] = None
        if depth > 0:
            self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
            self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()
            for _ in range(depth):
                self._slots.put(None)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_produce,
                args=(chunks, prepare, self._items, self._slots, self._stop),
                name="mpidist-prefetch",
                daemon=True,
            )
            self._thread.start()
            weakref.finalize(self, self._stop.set)

    def get(self) -> Optional[Chunk]:
        """The next chunk, ``None`` at the end; re-raises the source's exception."""
        if self._ended:
            return None
        item: _Item
        if self._thread is None:
            item = next(self._chunks, None)
            if item is not None and self._prepare is not None:
                item = item.map_leaves(self._prepare)
        else:
            item = self._items.get()
            self._slots.put(None)
        if item is None:
            self._ended = True
            return None
        if isinstance(item, _Failure):
            self._ended = True
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread (it exits within 50 ms, or after the source's current ``next()``)."""
        self._ended = True
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=1.0)
