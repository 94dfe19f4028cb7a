"""What the ranks agree on before a collective: one record per rank, compared on every rank.

Before each collective every rank validates its own arguments and builds a
fixed-size record of the call (sequence number, kind, reduce op, dtype,
shape, and why it cannot take part, if it cannot). The ranks exchange their
records and compare them: a disagreement, or a rank with invalid arguments,
raises on every rank before any data moves (the rank at fault raises its own
``TypeError``/``ValueError``, the others :class:`~mpidist.CollectiveMismatchError`
naming it). With a timeout the exchange is polled against the deadline, so the
waiting ranks can name the ranks that never arrived
(:class:`~mpidist.CollectiveTimeoutError`).

The small API the communicator and the fused reductions use:
:meth:`Agreement.agree` (one array), :meth:`Agreement.agree_many` (a list of
arrays, one record for the whole list) and :func:`validate`.
"""
from __future__ import annotations

import enum
import time
import warnings
import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpidist._comm.backend import array_module
from mpidist._comm.reduce_op import ReduceOp
from mpidist._comm.transport import Transport
from mpidist._errors import CollectiveMismatchError, CollectiveTimeoutError, NonFiniteError, format_ranks

__all__ = ["Agreement", "Bad", "FLOATS", "Kind", "local_error", "validate"]

# dtype chars MPI can move; their position is the dtype's code in agreement records.
DTYPES = "?bhilqBHILQefdFD"
FLOATS = frozenset("efdFD")
_COMPLEX = frozenset("FD")


class Kind(enum.IntEnum):
    """Which collective a record describes."""

    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    REDUCE_SCATTER = 4
    BARRIER = 5
    FUSED = 6


class Bad(enum.IntEnum):
    """Why a rank could not take part, sent in its record."""

    OK = 0
    NOT_ARRAY = 1
    NOT_CONTIGUOUS = 2
    DTYPE = 3
    OP_FOR_DTYPE = 4
    OTHER = 5


_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_DTYPE_CODES = {c: i for i, c in enumerate(DTYPES)}
_MAXDIM = 8
# Columns of a record. _DIMS.. hold dims 1 and up (the last slot the product of any dims past
# _MAXDIM); _DIM0 the length along axis 0, compared except in allgather; _NONFINITE is per-rank
# information, never compared. Ranks agree when their records match up to _DIM0.
_SEQ, _KIND, _OP, _DTYPE, _NDIM, _BAD, _ROOT, _DIMS = range(8)
_DIM0 = _DIMS + _MAXDIM - 1
_NONFINITE = _DIM0 + 1
_RECORD = _NONFINITE + 1
_TAG_AGREE = 7701


def local_error(bad: Bad, message: str) -> Exception:
    """The exception a rank raises for its own invalid arguments."""
    return (TypeError if bad in (Bad.NOT_ARRAY, Bad.DTYPE, Bad.NOT_CONTIGUOUS) else ValueError)(message)


def validate(array: Any, op: Optional[ReduceOp], name: str, rank: int) -> tuple[Bad, str]:
    """Local checks of one rank's array argument: (reason, message), or ``(Bad.OK, "")``."""
    where = f"rank {rank}: {name!r}"
    if not (hasattr(array, "dtype") and hasattr(array, "shape") and hasattr(array, "flags")):
        return Bad.NOT_ARRAY, (f"{where} is a {type(array).__name__}, not an array; pass a NumPy "
                               "or CuPy array (numpy.asarray(x))")
    char = array.dtype.char
    if char not in DTYPES:
        return Bad.DTYPE, (f"{where} has dtype {array.dtype}, which mpidist cannot send; use one of "
                           "bool, int8-64, uint8-64, float16/32/64, complex64/128")
    if not array.flags.c_contiguous:
        return Bad.NOT_CONTIGUOUS, (f"{where} (shape {tuple(array.shape)}, dtype {array.dtype}) is not "
                                    "C-contiguous; pass a contiguous copy (numpy.ascontiguousarray(x))")
    if op is ReduceOp.MEAN and char not in FLOATS:
        return Bad.OP_FOR_DTYPE, (f"{where}: MEAN of dtype {array.dtype} would truncate; reduce a "
                                  "floating-point copy, or use SUM and divide yourself")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and char in _COMPLEX:
        return Bad.OP_FOR_DTYPE, f"{where}: {op.name} is not defined for complex dtype {array.dtype}"
    return Bad.OK, ""


def _describe(record: np.ndarray) -> str:
    """Human form of one record, e.g. ``#3 allreduce(sum) float32[3, 4]``."""
    seq, kind, op, dcode, ndim, bad, root = (int(x) for x in record[:_DIMS])
    name = Kind(kind).name.lower() if kind in Kind._value2member_map_ else f"kind{kind}"
    if bad:
        return f"#{seq} {name}: could not take part ({Bad(bad).name.lower().replace('_', ' ')})"
    if kind == Kind.FUSED:
        return f"#{seq} fused reduction of {ndim} arrays, {int(record[_DIMS + 1])} elements"
    opname = next((o.value for o, c in _OP_CODES.items() if c == op), None)
    dims = [int(d) for d in record[_DIMS:_DIMS + min(ndim, _MAXDIM) - 1]]
    if ndim:
        dims.insert(0, int(record[_DIM0]))
    dtype = np.dtype(DTYPES[dcode]).name if 0 <= dcode < len(DTYPES) else "?"
    text = f"#{seq} {name}"
    if opname:
        text += f"({opname})"
    if kind == Kind.BROADCAST:
        text += f"(root={root})"
    if kind != Kind.BARRIER:
        text += f" {dtype}{dims}"
    return text


def _grouped(texts: dict[int, str]) -> str:
    """``"ranks 0, 2: text; rank 1: other"``: ranks grouped by identical text, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for r, text in texts.items():
        groups.setdefault(text, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}: {text}" for text, rs in groups.items())


class Agreement:
    """The agreement step of every collective over ``transport``.

    Local construction. :meth:`agree` and :meth:`agree_many` are collective.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._options = transport.options

    @property
    def enabled(self) -> bool:
        """Whether records are exchanged (``check_collectives``, or a timeout to honour)."""
        return self._options.check_collectives or self._options.timeout is not None

    def agree(self, kind: Kind, array: Any, op: Optional[ReduceOp], *, root: int = 0,
              name: str, check_finite: bool = False) -> Optional[np.ndarray]:
        """Collective: validate locally, then (if enabled) exchange records and compare them on every rank.

        Returns all ranks' records (``size x record``) or ``None`` when the
        exchange is disabled. Raises the local error on a rank whose arguments
        are invalid and :class:`CollectiveMismatchError` on the others.
        """
        t = self._transport
        t.begin()
        bad, message = (Bad.OK, "") if kind == Kind.BARRIER else validate(array, op, name, t.rank)
        if not (self.enabled or check_finite):
            if bad:
                raise local_error(bad, message)
            return None
        fields = [t.seq, kind, _OP_CODES.get(op, 0), 0, 0, bad, root] + [0] * (_RECORD - _DIMS)
        if kind != Kind.BARRIER and not bad:
            shape = array.shape
            fields[_DTYPE] = _DTYPE_CODES[array.dtype.char]
            fields[_NDIM] = len(shape)
            if shape:
                rest = list(shape[1:_MAXDIM - 1])
                if len(shape) >= _MAXDIM:
                    rest.append(int(np.prod(shape[_MAXDIM - 1:])))
                fields[_DIMS:_DIMS + len(rest)] = rest
                fields[_DIM0] = shape[0]
            if check_finite and array.dtype.char in FLOATS:
                fields[_NONFINITE] = int(not bool(array_module(array).isfinite(array).all()))
        return self._settle(kind, np.array(fields, dtype=np.int64), bad, message, name)

    def agree_many(self, arrays: Sequence[Any], ops: Sequence[Optional[ReduceOp]], names: Sequence[str]) -> str:
        """Collective: validate and agree on a whole list of reductions with one record; returns its description.

        ``ops[i]`` ``None`` means a broadcast of rank 0's value. When the ranks
        disagree, a second exchange names the first array that differs.
        """
        t = self._transport
        if len(arrays) == 1:
            kind = Kind.BROADCAST if ops[0] is None else Kind.ALLREDUCE
            self.agree(kind, arrays[0], ops[0], name=names[0],
                       check_finite=self._options.check_finite and ops[0] is not None)
            return ("broadcast of " if ops[0] is None else "allreduce of ") + repr(names[0])
        what = f"fused reduction of {len(arrays)} arrays ({_names(names)})"
        seq = t.begin()
        bad, message = Bad.OK, ""
        for a, op, name in zip(arrays, ops, names):
            bad, message = validate(a, op, name, t.rank)
            if bad:
                break
        check_finite = self._options.check_finite
        if not (self.enabled or check_finite):
            if bad:
                raise local_error(bad, message)
            return what
        layout = [] if bad else [_describe_array(a, op, name) for a, op, name in zip(arrays, ops, names)]
        record = np.zeros(_RECORD, dtype=np.int64)
        record[_SEQ], record[_KIND], record[_NDIM], record[_BAD] = seq, Kind.FUSED, len(arrays), bad
        record[_DIMS] = zlib.crc32("\n".join(f"{op} {a.dtype.str}{a.shape}" for a, op in zip(arrays, ops)).encode()
                                   ) if not bad else 0
        record[_DIMS + 1] = sum(int(a.size) for a in arrays) if not bad else 0
        if check_finite and not bad:
            record[_NONFINITE] = any(not bool(array_module(a).isfinite(a).all())
                                     for a, op in zip(arrays, ops) if op is not None and a.dtype.char in FLOATS)

        def explain() -> str:
            tables = [b.decode().split("\n") for b in t.allgather_bytes("fused layout", "\n".join(layout).encode())]
            for i in range(max(len(table) for table in tables)):
                column = {r: table[i] if i < len(table) else "(no such array)" for r, table in enumerate(tables)}
                if len(set(column.values())) > 1:
                    return f"; first difference at array #{i}: {_grouped(column)}"
            return ""

        self._settle(Kind.FUSED, record, bad, message, what, explain)
        return what

    def allgather_lengths(self, records: np.ndarray) -> np.ndarray:
        """Local: each rank's length along axis 0, from the records of an allgather."""
        return np.where(records[:, _NDIM] > 0, records[:, _DIM0], 1)

    # -- the exchange -----------------------------------------------------------------------
    def _settle(self, kind: Kind, record: np.ndarray, bad: Bad, message: str, name: str,
                explain: Optional[Callable[[], str]] = None) -> np.ndarray:
        """Collective: exchange this rank's ``record``; raise on any disagreement.

        ``explain`` (collective, run on every rank when all took part but
        disagree) returns text to add to the mismatch error.
        """
        t = self._transport
        records = self._exchange(record, kind, name)
        if bad:
            raise local_error(bad, message)
        if not record[_NONFINITE] and records.tobytes() == record.tobytes() * t.size:
            return records  # the common case: every rank sent the same record
        self._compare(kind, records, name, explain)
        if records[:, _NONFINITE].any():
            nonfinite = [r for r in range(t.size) if records[r, _NONFINITE]]
            raise NonFiniteError(
                f"rank {t.rank}: {kind.name.lower()} of {name!r}: rank{'s' if len(nonfinite) > 1 else ''} "
                f"{format_ranks(nonfinite)} contributed NaN or Inf; nothing was reduced, so the other replicas "
                "keep finite values. Find where the non-finite values come from (learning rate, loss scale, "
                "bad input), or turn the guard off with check_finite=False.", nonfinite)
        return records

    def _compare(self, kind: Kind, records: np.ndarray, name: str,
                 explain: Optional[Callable[[], str]] = None) -> None:
        t = self._transport
        key = records[:, :_DIM0 if kind == Kind.ALLGATHER else _DIM0 + 1]
        if (key == key[0]).all():
            return
        described = {r: _describe(records[r]) for r in range(t.size)}
        lines = _grouped(described)
        if explain is not None and not records[:, _BAD].any():
            lines += explain()
        raise CollectiveMismatchError(
            f"rank {t.rank}: ranks disagree on collective #{int(records[t.rank, _SEQ])} ({kind.name.lower()} of "
            f"{name!r}): {lines}. Every rank must call the same collectives in the same order with "
            "arrays of the same dtype and shape; no array was modified.",
            described,
        )

    def _exchange(self, record: np.ndarray, kind: Kind, name: str) -> np.ndarray:
        """Every rank's record, via Allgather, or polled point-to-point messages under a timeout."""
        t = self._transport
        records = np.empty((t.size, _RECORD), dtype=np.int64)
        timeout = self._options.timeout
        if timeout is None:
            t.call("agreement", t.comm.Allgather, record, records)
            return records
        what = f"{kind.name.lower()} of {name!r}"
        records[t.rank] = record
        peers = [r for r in range(t.size) if r != t.rank]
        recvs = [t.call("agreement", t.comm.Irecv, records[r], r, _TAG_AGREE) for r in peers]
        sends = [t.call("agreement", t.comm.Isend, record, r, _TAG_AGREE) for r in peers]
        deadline = time.monotonic() + timeout
        warn_at = time.monotonic() + timeout / 2
        warned = False
        pause = 0.0
        while not MPI.Request.Testall(recvs):
            now = time.monotonic()
            missing = [r for r, q in zip(peers, recvs) if q != MPI.REQUEST_NULL and not q.Test()]
            if now >= deadline:
                for q in recvs + sends:
                    if q != MPI.REQUEST_NULL:
                        q.Cancel()
                t.broken = f"ranks {format_ranks(missing)} never joined {what} (collective #{t.seq})"
                raise CollectiveTimeoutError(
                    f"rank {t.rank}: rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} did not "
                    f"join {what} (collective #{t.seq}) within {timeout:g} s. A rank that "
                    "skips a collective, calls a different one, or died leaves the others waiting; every "
                    "rank must call the same collectives in the same order.", missing)
            if not warned and now >= warn_at and missing:
                warned = True
                warnings.warn(f"mpidist rank {t.rank}: still waiting for rank(s) {format_ranks(missing)} "
                              f"to join {what} (collective #{t.seq}) after {timeout / 2:g} s",
                              RuntimeWarning, stacklevel=5)
            pause = min(1e-3, pause * 2 or 1e-6)
            time.sleep(pause)
        MPI.Request.Waitall(sends)
        return records


def _describe_array(array: Any, op: Optional[ReduceOp], name: str) -> str:
    how = "rank 0's value" if op is None else op.value
    return f"{name!r} {how} {array.dtype.name}{list(array.shape)}"


def _names(names: Sequence[str], shown: int = 3) -> str:
    listed = ", ".join(repr(n) for n in names[:shown])
    return listed + (f", ... {len(names) - shown} more" if len(names) > shown else "")
