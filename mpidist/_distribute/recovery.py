"""Carrying on after ranks died: the snapshot of a step's start, and the survivors' recovery.

With ``fault_tolerance`` on, the communicator turns the death of ranks into
:class:`~mpidist.RankFailedError` on every survivor and rebuilds itself over
them (:mod:`~mpidist._comm.survival`). What the survivors hold may then differ
by the one collective that was in flight: some survivors completed it (and
went on to the next one), the others did not. :func:`recover` makes them
alike again, collectively:

- with a snapshot (:meth:`Snapshot.take`, at the start of each step), every
  survivor returns to the newest snapshot any survivor holds, broadcast
  bitwise from the first survivor that holds it. A survivor that holds a
  newer snapshot than another completed every collective of the step the
  other one was in, so this completes that step everywhere; the program's
  state saved with the snapshot (its position: epoch, step, the input
  iterator's state) comes back with it, so the program knows where to go on;
- without one, every mirrored variable is broadcast from the first survivor
  that got furthest (the collective in flight completed there): each
  variable is whole, but a step that updates several variables may have
  updated some and not others.

Sync-on-read variables keep each survivor's own component; the dead ranks'
parts are lost, and their next reads warn so until they are assigned (a
metric's ``reset_state()``). The variables' components are renumbered to the
survivors' new ranks.
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from mpidist._distribute.variables import DistributedVariable, MirroredVariable, SyncOnReadVariable
from mpidist._errors import RankFailedError, on_rank
from mpidist._values.values import renumber_replica

if TYPE_CHECKING:
    from mpidist._comm.communicator import Communicator
    from mpidist._typing import Array

__all__ = ["Snapshot", "recover"]

_TRIES = 8  # further failures during a recovery: each one starts it again over the fewer survivors


class Snapshot:
    """Copies of a strategy's mirrored variables and the program's state at the start of a step. Local object.

    Every rank takes its snapshots at the same points of the program, so
    the ``count``-th snapshot is the same on every rank that took it.
    """

    def __init__(self) -> None:
        self.count = 0
        self.state: dict[str, Any] = {}
        self._copies: dict[int, tuple[weakref.ref[DistributedVariable], Array]] = {}

    def take(self, variables: list[DistributedVariable], state: dict[str, Any], rank: int) -> None:
        """Local: copy every mirrored variable (into the buffers of the last snapshot) and keep ``state``.

        ``state`` must be JSON-serialisable (numbers, strings, lists and dicts
        of them, such as an input iterator's ``get_state()``): the survivors
        receive it from the one whose snapshot they return to. Anything else
        raises ``TypeError`` naming the keyword (``rank``: this rank's, for the message).
        """
        for key, value in state.items():  # refused here, on this rank, rather than in the survivors' recovery
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    on_rank(
                        rank,
                        f"strategy.snapshot({key}=...): the state must be JSON values (numbers, strings, lists and "
                        f"dicts of them, such as an iterator's get_state()), got {type(value).__name__}: {exc}",
                    )
                ) from exc
        copies: dict[int, tuple[weakref.ref[DistributedVariable], Array]] = {}
        for v in variables:
            if not isinstance(v, MirroredVariable):
                continue
            kept = self._copies.get(id(v))
            buffer = kept[1] if kept is not None and kept[0]() is v else None
            if buffer is None or buffer.shape != v.component.shape or buffer.dtype != v.component.dtype:
                buffer = v.component.copy()
            else:
                buffer[...] = v.component
            copies[id(v)] = (weakref.ref(v), buffer)
        self._copies = copies
        self.state = dict(state)
        self.count += 1

    def copy_of(self, variable: DistributedVariable) -> Any:
        """Local: ``variable``'s component at the snapshot, or ``None`` (created since, or no snapshot)."""
        kept = self._copies.get(id(variable))
        return kept[1] if kept is not None and kept[0]() is variable else None


def recover(
    communicator: Communicator, variables: list[DistributedVariable], snapshot: Snapshot, origins: list[int]
) -> dict[str, Any]:
    """Collective over the survivors, after :class:`~mpidist.RankFailedError`: make them alike again.

    Returns the state saved with the snapshot they returned to (``{}``
    without one). A further failure meanwhile is recovered from too.
    ``origins`` (each rank's rank when the strategy was created, by its rank
    now) loses the dead ranks; the sync-on-read variables name them by it.
    """
    if communicator.cut_off is not None:  # this side stops: no recovery
        raise communicator.cut_off
    failure = communicator.last_failure
    if failure is None:
        why = (
            "no rank of this strategy died since it was created or last recovered"
            if communicator.options.fault_tolerance
            else "this strategy's fault_tolerance is off, so its communicator is not rebuilt over the survivors "
            "(create the strategy with fault_tolerance=True, or set MPIDIST_FAULT_TOLERANCE=1)"
        )
        raise RuntimeError(
            on_rank(communicator.rank, f"strategy.recover() is for the survivors of a RankFailedError; {why}")
        )
    dead = failure.failed_ranks
    for _ in range(_TRIES):
        communicator.release_hold()  # the strategy's collectives were refused since the failure
        lost = [origins[r] for r in dead]
        origins[:] = [o for r, o in enumerate(origins) if r not in dead]
        for v in variables:  # the dead ranks' parts of sync-on-read values are lost: their reads will say so
            if isinstance(v, SyncOnReadVariable):
                v.lost_ranks = tuple(sorted({*v.lost_ranks, *lost}))
            renumber_replica(v, communicator.rank)
        try:
            state = _restore(communicator, variables, snapshot)
        except RankFailedError as again:  # more ranks died meanwhile: their parts are lost too
            dead = list(again.failed_ranks)
            continue
        communicator.last_failure = None
        return state
    raise RuntimeError(on_rank(communicator.rank, f"ranks kept dying: {_TRIES} recoveries in a row failed"))


def _restore(communicator: Communicator, variables: list[DistributedVariable], snapshot: Snapshot) -> dict[str, Any]:
    """Collective over the survivors: every mirrored variable (and the state) from the survivor to return to."""
    counts = communicator.allgather(np.array([snapshot.count], dtype=np.int64), name="recovery (snapshots)").tolist()
    newest = max(counts)
    if newest:
        source = counts.index(newest)
    else:
        assert communicator.last_failure is not None
        source = communicator.last_failure.progress.ahead[0]
    mine = communicator.rank == source
    for v in variables:
        if not isinstance(v, MirroredVariable):
            continue
        kept = snapshot.copy_of(v) if mine and newest else None
        if kept is not None:
            v.component[...] = kept
        communicator.broadcast(v.component, root=source, name=f"recovery of {v.name!r}")
    if not newest:
        return {}
    text = communicator.broadcast_bytes(json.dumps(snapshot.state).encode() if mine else None, source, name="state")
    snapshot.state = json.loads(text.decode())
    snapshot.count = newest
    return dict(snapshot.state)
