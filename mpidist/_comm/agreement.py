"""What the ranks agree on before a collective: one fixed-size reduction, compared on every rank.

Protocol. Every collective starts with one ``MPI_Allreduce`` (``SUM``) of a
fixed-size ``float64`` record, through a persistent request created with the
communicator. Each rank fills the record with

- a hash of the call it is about to make (kind, reduce op, dtype, shape,
  root, extra arguments such as ``reduce_scatter`` counts or the update a
  fused reduction applies, and the *name* of the value or variable, which
  carries the path of a leaf in a nest and the ``axis`` of a reduction),
  split into ``K`` integers ``h_k`` of ``b`` bits, each sent together with its
  square; dtype aliases (``'l'`` and ``'q'`` for int64) are one dtype, and the
  output form (a new array, ``out=``, in place) is not part of the call;
- the stamp ``s``, the collective's sequence number plus ``4096`` times the
  steps this rank drew from mpidist's input iterators (modulo ``2**b``), and
  its square, so that a rank that skipped a step disagrees in that step;
- counters: 1 if this rank's own arguments are invalid, 1 if its data holds
  NaN or Inf (with ``check_finite``), 1 if it is leaving the job, 1 if it
  asks for a coordinated stop; then 1 if fault tolerance is on (written
  once, in the record's template), and two reserved slots, 0 today (a
  wire-encoding id: see docs/collective-safety.md);
- for a small ``SUM``/``MEAN`` reduction of a host array, the data itself
  (up to :data:`SMALL` elements), so that the agreement and the reduction are
  one MPI call; for a small alltoall, a grid of its rows or counts in which
  each rank fills its own column (:class:`~mpidist._comm.exchange.AlltoallPlan`);
- last, five slots of the straggler report (:mod:`~mpidist._comm.straggler`),
  written once per stretch of collectives and never compared: this rank's time
  outside waiting in the last stretch and its square, and its late mark.

Every rank then sees the sums. All ranks sent the same value ``v`` exactly
when ``sum(v) == N*v`` and ``sum(v**2) == N*v**2`` (the squared deviations from
``v`` add up to zero), which each rank checks against its own values; ``b``
is chosen so that ``N * 2**(2b)`` stays below ``2**53``, where ``float64``
sums of integers are exact in any order. So every rank reaches the same
verdict without seeing the others' records. Only when the verdict is "they
differ" (or some rank's arguments are invalid, or some data is not finite)
do the ranks gather per-rank descriptions (a second, variable-size exchange)
to name the ranks and what each of them passed.

Cost per rank and collective: one allreduce of ``8 * (SMALL + 22)`` bytes,
``O(log N)`` latency, the same size at any ``N``; nothing more unless
something is wrong. A deadline (``options.timeout``) is honoured by polling
the request (:meth:`~mpidist._comm.deadline.Deadline.poll`).

Each call's ``file:line`` in the program is found (a walk up the stack) the
first time this rank makes a call of that identity, and when a message needs
it; never per collective.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np
from mpi4py import MPI

from mpidist._comm.backend import array_module, device_into_host, is_device_array
from mpidist._comm.call_site import Site, call_site, caller
from mpidist._comm.outcome import gather_texts, group_ranks
from mpidist._comm.reduce_op import ReduceOp
from mpidist._comm.straggler import STRETCH, Straggler, named_ranks
from mpidist._comm.transport import Transport
from mpidist._dtypes import is_bfloat16
from mpidist._errors import (
    CollectiveMismatchError,
    MpidistError,
    NonFiniteError,
    RankLeftError,
    format_ranks,
    on_rank,
)

if TYPE_CHECKING:
    from mpidist._typing import Array

    # What a call moves: one array, the list of arrays of a fused reduction, or nothing (a barrier).
    CallData = Union[Array, list[Array], tuple[Array, ...], None]

__all__ = ["Agreement", "Call", "Kind", "Ticket", "leave_all", "validate", "validate_out", "word_bits"]

# dtype chars MPI can move: NumPy's, and bfloat16 of ml_dtypes (NumPy has none), a user-defined NumPy dtype
# whose char is BFLOAT16. ml_dtypes' other dtypes reuse chars of NumPy's (int1 'e', float8_e4m3b11fnuz 'L',
# uint1 'E'): validate() tells them apart.
BFLOAT16 = "E"
DTYPES = "?bhilqBHILQefdFD" + BFLOAT16
FLOATS = frozenset("efdFD" + BFLOAT16)
_COMPLEX = frozenset("FD")
# dtypes whose SUM travels exactly inside the float64 record (integers below 2**33, floats; 16-bit floats are
# summed there in float64 and rounded once).
_CARRIED = frozenset("?bhiBHIefd" + BFLOAT16)
_USER_DTYPES = 256  # NumPy numbers user-defined dtypes (dtype.num) from here on
SMALL = 32  # data slots of the record: reductions of up to this many elements need one MPI call
_K = 3  # hash words

# Record slots after the data: the flags, the stamp, the hash words (docs/collective-safety.md, "The record").
# _FAULT is 1 on a rank with fault tolerance on (in the template, never written per call); _WIRE1 and _WIRE2
# are reserved: 0 on every rank today, so that what later rides in the record (a wire-encoding id and its
# square) changes neither its size nor the agreed verdict of a program that does not use it.
_BAD, _NONFINITE, _LEAVING, _LEFT1, _LEFT2, _STOP, _FAULT, _WIRE1, _WIRE2, _SEQ = range(SMALL, SMALL + 10)
_HASH = _SEQ + 2  # _SEQ, _SEQ + 1: the stamp s and s**2; then h_k, h_k**2 for k < _K
# The straggler report's slots, after what the verdict compares (their sums differ from call to call): a rank's
# time outside waiting in the last stretch and its square, and its late mark (count, rank+1, (rank+1)**2).
_TIME1, _TIME2, _LATE, _LATE1, _LATE2 = range(_HASH + 2 * _K, _HASH + 2 * _K + 5)
_SIZE = _LATE2 + 1
_CLEAR = (0.0, 0.0, 0.0)
# The per-collective path spells the offsets of the compared tail (the record from _BAD up to _TIME1) as
# literals: check them here.
assert (_SEQ, _SEQ - _BAD, _HASH - _BAD, _TIME1 - _BAD, _TIME1, _LATE2) == (41, 9, 11, 17, 49, 53), (
    "update the literal offsets in Agreement.agree_planned/_verify/_stretch"
)
_STRETCH_MASK = STRETCH - 1  # collective numbers n with n & _STRETCH_MASK == 0 begin a stretch of the straggler report
assert _STRETCH_MASK == 15, "update the literal stretch mask in Agreement.agree_planned (STRETCH: a power of two)"
_STEP_STRIDE = 1 << 12  # the stamp is (sequence number + input steps * this + steps left * _LEFT_STRIDE) mod 2**bits
_LEFT_STRIDE = (1 << 19) + 1  # odd: one step left by an exception changes the stamp whatever the number of bits


class Kind(enum.IntEnum):
    """Which collective a record describes."""

    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    REDUCE_SCATTER = 4
    BARRIER = 5
    FUSED = 6
    CREATE = 7  # a communicator's creation: the options every rank must share
    ALLTOALL = 8  # extra: (rows to each rank,) for even splits; None for splits of each rank's own
    GATHER = 9
    SCATTER = 10  # only the root holds the arrays: their dtype and shapes are not compared
    SPLIT = 11  # a split into process sets (each rank's colour and key are its own: not compared)

    __hash__ = int.__hash__  # as its int value, at C speed (kinds key caches)


# Kinds whose arrays may differ in length along axis 0 between ranks (the rest of the shape is compared).
_ROWS_MAY_DIFFER = frozenset({Kind.ALLGATHER, Kind.ALLTOALL, Kind.GATHER})

# One char per dtype: aliases of the same dtype ('l' and 'q' are both int64 on Linux) are one dtype.
_NUMPY_DTYPES = DTYPES.replace(BFLOAT16, "")
_CANONICAL = {c: next(d for d in _NUMPY_DTYPES if np.dtype(d) == np.dtype(c)) for c in _NUMPY_DTYPES}
_CANONICAL[BFLOAT16] = BFLOAT16


class Call:
    """What one rank is about to do: the identity the ranks agree on, and how to describe it.

    ``shape`` is compared whole except for ``ALLGATHER``, ``ALLTOALL`` and
    ``GATHER``, whose first dimension may differ. ``extra`` holds further
    arguments every rank must pass alike (``reduce_scatter`` counts, a fused
    layout, the update a fused reduction applies, a creation's options). ``dtype`` is compared as a dtype,
    not as the char that spells it. ``wire`` is the encoding of a compressed reduction
    (:mod:`~mpidist._comm.compression`; ``None``: exact), part of the call when given.
    """

    __slots__ = ("kind", "op", "dtype", "shape", "name", "root", "extra", "wire", "key")

    def __init__(
        self,
        kind: Kind,
        name: str,
        op: Optional[ReduceOp] = None,
        dtype: str = "",
        shape: tuple = (),
        root: int = 0,
        extra: Optional[tuple] = None,
        wire: Optional[str] = None,
    ) -> None:
        self.kind, self.op, self.dtype, self.shape = kind, op, _CANONICAL.get(dtype, dtype), shape
        self.name, self.root, self.extra, self.wire = name, root, extra, wire
        compared = shape[1:] if kind in _ROWS_MAY_DIFFER else shape
        key: tuple = (kind, op, self.dtype, compared, len(shape), name, root, extra)
        self.key = key if wire is None else (*key, wire)  # exact calls keep their identity

    def describe(self) -> str:
        """E.g. ``allreduce(sum) of 'w' float32[3, 4]`` (``... compressed to fp16`` for a compressed one)."""
        return self._described() + ("" if self.wire is None else f" compressed to {self.wire}")

    def _described(self) -> str:
        if self.kind == Kind.CREATE:
            return f"creation of {self.name}"
        if self.kind == Kind.FUSED:
            return f"fused reduction of {self.name}" + _update_words(self.extra[2] if self.extra else None)
        text = self.kind.name.lower()
        if self.op is not None:
            text += f"({self.op.value})"
        if self.kind in (Kind.BROADCAST, Kind.GATHER, Kind.SCATTER):
            text += f"(root={self.root})"
        text += f" of {self.name!r}"
        if self.kind not in (Kind.BARRIER, Kind.SPLIT, Kind.SCATTER):
            dims = list(self.shape)
            text += f" {dtype_name(self.dtype) if self.dtype else '?'}{dims}"
        if self.kind == Kind.REDUCE_SCATTER and self.extra is not None:
            text += f" counts {list(self.extra)}"
        elif self.kind == Kind.ALLTOALL and self.dtype:
            text += " split evenly" if self.extra is not None else " with splits"
        elif self.extra is not None and self.kind in (Kind.ALLREDUCE, Kind.BROADCAST):
            text += _update_words(self.extra[0])
        return text

    def __str__(self) -> str:
        return self.describe()

    def layout(self) -> list[str]:
        """One line per array of a fused reduction, or per option of a creation (empty for other calls)."""
        if self.kind == Kind.CREATE:
            return list(self.extra or ())
        if self.kind != Kind.FUSED or not self.extra:
            return []
        specs, names, _ = self.extra
        return [
            f"{name!r} {op or 'rank 0s value'} {dtype_name(dtype)}{list(shape)}"
            for (op, dtype, shape), name in zip(specs, names)
        ]


def dtype_name(spelling: str) -> str:
    """Local: the name of the dtype a call spells as ``spelling`` (its char, or ``dtype.str``), for messages.

    bfloat16 is spelled :data:`BFLOAT16`, or ``'<V2'`` as ``dtype.str``: the only dtype of kind ``'V'``
    that :func:`validate` takes.
    """
    if spelling == BFLOAT16:
        return "bfloat16"
    dtype = np.dtype(spelling)
    return "bfloat16" if dtype.kind == "V" else dtype.name


def word_bits(size: int) -> int:
    """Local: bits per hash word at ``size`` ranks, the most for which ``size * 2**(2b) <= 2**52`` (at least 8).

    Sums of ``size`` such words and of their squares are exact in ``float64`` in any order.
    """
    return max(8, (52 - math.ceil(math.log2(max(size, 2)))) // 2)


def update_identity(fn: Any) -> Optional[str]:
    """Local: what identifies the update ``fn`` a reduction applies, for the ranks to compare (``None``: no update).

    Its qualified name and where it was defined (``file:line``); the values it
    captures are not compared. Functions without code of their own (builtins,
    ``functools.partial``) are identified by their type's name.
    """
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    if code is None:
        return type(fn).__qualname__
    return f"{getattr(fn, '__qualname__', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"


def _update_words(update: Optional[str]) -> str:
    """`` then <update>`` for a description (nothing when the call applies no update)."""
    return "" if update is None else f" then {update}"


def validate(array: Any, op: Optional[ReduceOp], name: str, rank: int, writable: bool = False) -> Optional[Exception]:
    """Local checks of one rank's array argument: the error to raise, or ``None``."""
    try:
        dtype, flags = array.dtype, array.flags
        char = dtype.char
        fine = (
            char in DTYPES
            and (dtype.num < _USER_DTYPES or is_bfloat16(dtype))
            and dtype.isnative
            and flags.c_contiguous
            and (flags.writeable or not writable)
            and (op is not ReduceOp.MEAN or char in FLOATS)
            and (char not in _COMPLEX or (op is not ReduceOp.MIN and op is not ReduceOp.MAX))
        )
    except AttributeError:
        fine = False
    return None if fine else _invalid(array, op, name, rank, writable)


def validate_out(array: Any, out: Any, label: str, like: str, rank: int) -> Optional[Exception]:
    """Local checks of one rank's ``out=`` for the reduction of its valid ``array``: the error to raise, or ``None``.

    ``label`` names the argument in messages (``"allreduce of 'x': out="``, ``"out[1]"``);
    ``like`` names the array it receives the reduction of.
    """
    if getattr(out, "shape", None) != array.shape or getattr(out, "dtype", None) != array.dtype:
        got = f"{getattr(out, 'shape', '?')} {getattr(out, 'dtype', type(out).__name__)}"
        return ValueError(
            on_rank(
                rank, f"{label} must have the input's shape {tuple(array.shape)} and dtype {array.dtype}, got {got}"
            )
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        return ValueError(on_rank(rank, f"{label} must be C-contiguous and writable"))
    if out.__class__ is not array.__class__ and device_into_host(array, out):
        return ValueError(
            on_rank(
                rank,
                f"{label} must be a device array like {like}, "
                f"got a {type(out).__module__}.{type(out).__name__} in host memory",
            )
        )
    return None


def _invalid(array: Any, op: Optional[ReduceOp], name: str, rank: int, writable: bool) -> Exception:
    """The error for an argument :func:`validate` refused."""
    kind, text = _why_invalid(array, op, writable)
    return kind(on_rank(rank, f"{name!r}{text}"))


def _why_invalid(array: Any, op: Optional[ReduceOp], writable: bool) -> tuple[type[Exception], str]:
    """The error class, and what is wrong with ``array`` (following its name), for :func:`_invalid`."""
    if not (hasattr(array, "dtype") and hasattr(array, "shape") and hasattr(array, "flags")):
        return TypeError, (f" is a {type(array).__name__}, not an array; pass a NumPy or CuPy array (numpy.asarray(x))")
    char = array.dtype.char
    if char not in DTYPES or not (array.dtype.num < _USER_DTYPES or is_bfloat16(array.dtype)):
        return TypeError, (
            f" has dtype {array.dtype}, which mpidist cannot send; use one of "
            "bool, int8-64, uint8-64, float16/32/64, bfloat16 (ml_dtypes), complex64/128"
        )
    if not array.dtype.isnative:
        return TypeError, (
            f" has non-native byte order ({array.dtype.str}); convert it first (x.astype(x.dtype.newbyteorder('=')))"
        )
    if not array.flags.c_contiguous:
        return TypeError, (
            f" (shape {tuple(array.shape)}, dtype {array.dtype}) is not "
            "C-contiguous; pass a contiguous copy (numpy.ascontiguousarray(x))"
        )
    if writable and not array.flags.writeable:
        return ValueError, " is read-only, but this collective writes into it; pass a writable copy"
    if op is ReduceOp.MEAN:
        return ValueError, (
            f": MEAN of dtype {array.dtype} would truncate; reduce a "
            "floating-point copy, or use SUM and divide yourself"
        )
    return ValueError, f": {op.name if op else '?'} is not defined for complex dtype {array.dtype}"


def carried(array: Array, op: Optional[ReduceOp]) -> bool:
    """Local: whether ``array`` reduced by ``op`` travels inside the record (small host SUM/MEAN)."""
    return (
        (op is ReduceOp.SUM or op is ReduceOp.MEAN)
        and array.size <= SMALL
        and array.dtype.char in _CARRIED
        and (array.__class__ is np.ndarray or not is_device_array(array))
    )


class Ticket:
    """An agreement in flight (started, not yet verified). Local object.

    ``then`` runs once the ranks agreed, with the reduced data slots (or
    ``None``); :meth:`test` / :meth:`wait` drive it. An error of the
    agreement (mismatch, a bad argument, a departed rank) is raised by
    whichever call completes it, and again by every later :meth:`wait`.
    """

    __slots__ = ("_agreement", "call", "error", "carry", "expected", "then", "done", "failure", "result")

    def __init__(
        self,
        agreement: Agreement,
        call: Call,
        error: Optional[Exception],
        carry: int,
        expected: list[float],
        then: Optional[Callable[[Optional[np.ndarray]], Any]],
    ) -> None:
        self._agreement = agreement
        self.call, self.error, self.carry, self.expected, self.then = call, error, carry, expected, then
        self.done = False
        self.failure: Optional[BaseException] = None
        self.result: Any = None

    @property
    def what(self) -> str:
        """The call, in words (for messages)."""
        return self.call.describe()

    def test(self) -> bool:
        """Local: complete the agreement if its reduction has arrived (may raise its error)."""
        if not self.done and self._agreement.transport.test([self._agreement.request]):
            self._agreement.settle(self)
        return self.done

    def wait(self) -> Any:
        """Local: block until the ranks agreed (honouring the deadline); returns what ``then`` returned."""
        if not self.done:
            self._agreement.transport.poll(self._agreement.request, self.call)
            self._agreement.settle(self)
        if self.failure is not None:
            raise self.failure
        return self.result


# Every agreement not yet freed, in creation order: held strongly, so that the departures at exit never depend on
# when the garbage collector of each rank frees a communicator.
_live: list[Agreement] = []
# What agree_array needs for one kind of call: the call, the carried size, this rank's hash words, the sums
# that mean "agreed", and the record's data slots shaped like the array (send and receive side; None if not carried).
_Plan = tuple[Call, int, tuple[float, ...], list[float], Any, Any]


class Agreement:
    """The agreement step of every collective over ``transport``.

    Collective construction (it creates the persistent request); :meth:`free`
    is collective too. :meth:`agree` / :meth:`start` are collective.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        o = transport.options
        # whether collectives are agreed (check_collectives, check_finite, or a timeout to honour); options are frozen
        self.enabled: bool = o.check_collectives or o.timeout is not None or o.check_finite
        n = transport.size
        self._bits = word_bits(n)
        self._mask = (1 << self._bits) - 1
        self._flags = _CLEAR  # bad, non-finite, stop: as last written into the record
        self._mine: tuple[float, ...] = ()  # the hash words last written
        self._send = np.zeros(_SIZE)
        self._recv = np.zeros(_SIZE)
        self._tail = self._recv[_BAD:_TIME1]  # what the verdict reads: flags, stamp, hash words
        # the tail of the summed record when every rank agrees on the call last written: flags and reserved
        # slots 0, the stamp's sums (set per call), the hash words' sums (set with _mine); the per-collective
        # path compares it with the summed tail as two memoryviews (one C comparison of 17 doubles)
        self._agreed_tail = np.zeros(_TIME1 - _BAD)
        self._agreed_words, self._tail_words = self._agreed_tail.data, self._tail.data
        if o.fault_tolerance:  # written once into the template: a rank with the mode off disagrees on every call
            self._send[_FAULT] = 1.0
            self._agreed_tail[_FAULT - _BAD] = n
        self.request: MPI.Prequest = transport.call(
            "agreement setup", transport.comm.Allreduce_init, self._send, self._recv, MPI.SUM
        )
        self._pending: Optional[Ticket] = None
        self._carried = 0  # data slots used by the previous record (to zero them lazily)
        self._hashes: dict[tuple, tuple[tuple[float, ...], list[float]]] = {}
        self._plans: dict[tuple, _Plan] = {}
        # where in the program this rank first made a call of each identity (its hash words)
        self._sites: dict[tuple[float, ...], Site] = {}
        # the straggler report: times measured whenever the agreement runs; the waits of blocking MPI calls too
        transport.time_blocking = self.enabled
        self.straggler = Straggler(transport.rank, n, o, time.perf_counter())
        self._mark: tuple[float, float, float] = _CLEAR  # the late mark in the record
        # item access at C speed (Any: typeshed types a memoryview's items as ints; these are float64)
        self._send_words: Any = self._send.data
        self._recv_words: Any = self._recv.data
        self.stop_requested = False  # this rank asks for a coordinated stop (carried in the next record)
        self.stop_agreed = False  # some rank asked; every rank learns it at the same collective
        # the stamp's part beyond the sequence number: input_steps * _STEP_STRIDE + steps_left * _LEFT_STRIDE
        self._steps_term = 0
        self._input_steps = 0
        self.steps_left = 0  # steps this rank left by an exception (count_step_left), and how it left the last
        self._last_left = ""
        _live.append(self)

    @property
    def input_steps(self) -> int:
        """Steps drawn from mpidist's input iterators over this communicator: part of every call's stamp."""
        return self._input_steps

    @input_steps.setter
    def input_steps(self, steps: int) -> None:
        self._input_steps = steps
        self._steps_term = steps * _STEP_STRIDE + self.steps_left * _LEFT_STRIDE

    def count_input_step(self) -> None:
        """Local: one more step drawn from an input iterator over this communicator."""
        self._input_steps += 1
        self._steps_term += _STEP_STRIDE

    def count_step_left(self, how: str) -> None:
        """Local: this rank left a step (``strategy.run``'s ``fn``, a ``merge_call``'s ``merge_fn``) by an
        exception, ``how`` (``"KeyError in merge_call"``): part of every later call's stamp. Where only some ranks
        left it, they skipped collectives the others are in; their next collective then disagrees on every rank
        instead of pairing with an unrelated one of the others."""
        self.steps_left += 1
        self._last_left = how
        self._steps_term += _LEFT_STRIDE

    def _stamp(self) -> float:
        """Local: what every rank's record carries in ``_SEQ``: the collective's number and the input steps drawn."""
        return float((self.transport.seq + self._steps_term) & self._mask)

    def free(self) -> None:
        """Collective: complete what is pending and release the persistent request."""
        if self._pending is not None and self.transport.broken is None:
            self._pending.wait()
        if self.request != MPI.REQUEST_NULL:
            self.request.Free()
        if self in _live:
            _live.remove(self)

    def drop(self) -> None:
        """Local, after ranks died (the transport is broken): let go of the persistent request without waiting."""
        self._pending = None
        try:
            self.request.Free()
        except MPI.Exception:  # its communicator is revoked: nothing of it can complete
            pass
        if self in _live:
            _live.remove(self)

    # -- starting and completing -------------------------------------------------------------
    def agree(
        self,
        call: Call,
        error: Optional[Exception] = None,
        data: CallData = None,
        check_finite: bool = False,
        carry: Optional[int] = None,
    ) -> Optional[np.ndarray]:
        """Collective: agree on ``call`` (blocking); returns the summed data slots, if the record carried data.

        ``error`` is this rank's own problem with its arguments: it is raised
        here, on this rank, once every rank has seen that it exists; the
        other ranks raise :class:`~mpidist.CollectiveMismatchError` naming
        this rank and the error. ``carry``: how many values of ``data`` (a
        float64 image of the data slots, see :meth:`plan`) the record
        carries; ``None`` carries a small host reduction's own data
        (:func:`carried`). (The per-collective path: kept short.)
        """
        if self._pending is not None:
            self._pending.wait()  # the previous nonblocking agreement completes first, on every rank
        carry, expected = self._fill(call, error, data, check_finite, carry)
        request = self.request
        request.Start()
        if not request.Test():
            self.transport.poll(request, call)
        return self._verify(call, error, carry, expected)

    def agree_array(
        self,
        kind: Kind,
        name: str,
        op: Optional[ReduceOp],
        array: Array,
        check_finite: bool = False,
        update: Any = None,
        wire: Optional[str] = None,
    ) -> Optional[np.ndarray]:
        """Collective: :meth:`agree` on a call of one valid array (the per-collective path, kept short).

        ``update`` is the function the caller applies to the reduced values
        (part of the call: :func:`update_identity`), or ``None``; ``wire`` the
        call's compression (``None``: exact). Returns the carried sums shaped
        like ``array`` (a view of the record: copy them out before the next
        collective), or ``None``.
        """
        return self.agree_planned(self.plan_array(kind, name, op, array, update, wire), array, check_finite)

    def plan_array(
        self,
        kind: Kind,
        name: str,
        op: Optional[ReduceOp],
        array: Array,
        update: Any = None,
        wire: Optional[str] = None,
    ) -> _Plan:
        """Local: the plan (:meth:`plan`) of :meth:`agree_array`'s call of ``array``; arguments as there.

        Calls alike in kind, name, op, dtype, shape, array type, update and
        wire share one plan: a caller that makes such calls over and over may
        keep it and call :meth:`agree_planned` itself.
        """
        code = update if update is None else getattr(update, "__code__", update.__class__)
        key = (kind, name, op, array.dtype.char, array.shape, array.__class__, code, wire)
        plan = self._plans.get(key)
        if plan is None:
            extra = None if update is None else (update_identity(update),)
            call = Call(kind, name, op, array.dtype.char, tuple(array.shape), extra=extra, wire=wire)
            carry = array.size if kind is Kind.ALLREDUCE and carried(array, op) else 0
            plan = self.plan(key, call, carry, tuple(array.shape))
        return plan

    def plan(self, key: tuple, call: Call, carry: int, shape: tuple) -> _Plan:
        """Local: what :meth:`agree_planned` needs for calls like ``call`` (cached per ``key``).

        ``carry``: how many data slots the record carries, whose values come
        shaped as ``shape`` (their sums come back so shaped); 0 for none.
        What a rank writes there is its own: the record carries each slot's
        sum over the ranks, exact for integers below ``2**53`` (a rank that
        moves values to another writes them into slots that every other rank
        leaves 0).
        """
        if len(self._plans) > 4096:
            self._plans.clear()
        mine, expected = self._identity(call, carry)
        into = self._send[:carry].reshape(shape) if carry else None
        out = self._recv[:carry].reshape(shape) if carry else None
        plan = self._plans[key] = (call, carry, mine, expected, into, out)
        return plan

    def agree_planned(self, plan: _Plan, data: Any, check_finite: bool = False) -> Optional[np.ndarray]:
        """Collective: :meth:`agree` on the call of ``plan`` (:meth:`plan`), carrying ``data`` if the plan does.

        Returns the carried sums (a view of the record, shaped as planned:
        copy them out before the next collective), or ``None``.
        """
        call, carry, mine, expected, into, out = plan
        if self._pending is not None or check_finite or self.stop_requested or self._flags is not _CLEAR:
            carried = self.agree(call, None, data, check_finite, carry)
            return None if carried is None else carried.reshape(out.shape)
        t = self.transport
        if t.broken is not None:
            raise t.unusable()
        t.seq = seq = t.seq + 1
        if carry:
            into[...] = data
        if self._carried > carry:
            self._send[carry : self._carried] = 0.0
        self._carried = carry
        agreed = self._agreed_tail
        if mine is not self._mine:
            self._send[_HASH:_TIME1] = self._mine = mine
            agreed[11:] = expected
            t.recent = (seq, call, self._sites.get(mine), *t.recent[1:3])
        s = float((seq + self._steps_term) & self._mask)
        send = self._send
        send[41] = s  # _SEQ, spelled out on this path
        send[42] = s2 = s * s
        n = t.size
        agreed[9] = n * s
        agreed[10] = n * s2
        if not seq & 15:  # _STRETCH_MASK, spelled out: the first collective of a stretch of the straggler report
            self._stretch(seq)
        request = self.request
        request.Start()
        t.poll(request, call)  # its first step is a test
        if self._tail_words == self._agreed_words:
            return out
        self._verify(call, None, carry, expected)
        return out

    def start(
        self,
        call: Call,
        error: Optional[Exception] = None,
        data: CallData = None,
        check_finite: bool = False,
        then: Optional[Callable[[Optional[np.ndarray]], Any]] = None,
        carry: Optional[int] = None,
    ) -> Ticket:
        """Collective, nonblocking :meth:`agree`: returns the :class:`Ticket` (``then`` runs on agreement).

        ``data`` is this rank's array (or list of arrays) of the call: checked
        for NaN/Inf with ``check_finite``, and carried inside the record when
        it is one small array reduced by ``SUM``/``MEAN`` (:func:`carried`);
        ``then`` then receives the reduced values as ``float64``. ``carry``:
        as in :meth:`agree`.
        """
        if self._pending is not None:
            self._pending.wait()
        carry, expected = self._fill(call, error, data, check_finite, carry)
        ticket = Ticket(self, call, error, carry, expected, then)
        self.transport.call("agreement", self.request.Start)
        self._pending = ticket
        return ticket

    def settle(self, ticket: Ticket) -> None:
        """Local, after the reduction arrived: verify it; run ``then`` or raise (on every rank alike)."""
        self._pending = None
        ticket.done = True
        try:
            carried = self._verify(ticket.call, ticket.error, ticket.carry, ticket.expected)
            ticket.result = ticket.then(carried) if ticket.then is not None else carried
        except BaseException as exc:
            ticket.failure = exc
            raise

    def _fill(
        self, call: Call, error: Optional[Exception], data: Any, check_finite: bool, carry: Optional[int] = None
    ) -> tuple[int, list[float]]:
        """Local: write this rank's record of ``call``; returns the carried size and the sums that mean "agreed".

        ``data`` is a :data:`CallData` (or a float64 image of ``carry`` data slots), typed ``Any``
        here: this per-collective path tells one array from a list by ``data.__class__``, which the
        type checker does not narrow on.
        """
        t = self.transport
        if t.broken is not None:
            raise t.unusable()
        t.seq += 1
        send = self._send
        if error is not None:
            carry = 0
        elif carry is None:
            carry = (
                data.size
                if call.kind is Kind.ALLREDUCE and data.__class__ is not list and carried(data, call.op)
                else 0
            )
        if carry:
            send[:carry] = data.reshape(-1)
        if self._carried > carry:
            send[carry : self._carried] = 0.0
        self._carried = carry
        if error is not None or check_finite or self.stop_requested or self._flags is not _CLEAR:
            flags = (
                float(error is not None),
                float(check_finite and error is None and _nonfinite(data)),
                float(self.stop_requested),
            )
            send[_BAD], send[_NONFINITE], send[_STOP] = flags
            self._flags = _CLEAR if flags == _CLEAR else flags
        mine, expected = self._identity(call, carry)
        if mine is not self._mine:
            send[_HASH:_TIME1] = self._mine = mine
            self._agreed_tail[_HASH - _BAD :] = expected
            t.recent = (t.seq, call, self._sites.get(mine), *t.recent[1:3])
        s = self._stamp()
        send[_SEQ] = s
        send[_SEQ + 1] = s * s
        if not t.seq & _STRETCH_MASK:
            self._stretch(t.seq)
        return carry, expected

    def _stretch(self, seq: int) -> None:
        """Local, at collective ``seq``, the first of a stretch: the straggler report's turn (its slots of the
        record: read what the last record summed, write this rank's new values)."""
        got, put = self._recv_words, self._send_words
        a, mark = self.straggler.stretch(
            time.perf_counter(), self.transport.waited, got[49], got[50], got[51], got[52], got[53], seq
        )
        put[49] = a  # _TIME1 and on, spelled out
        put[50] = a * a
        if mark is not self._mark:
            put[51], put[52], put[53] = self._mark = mark

    def leave(self) -> bool:
        """Collective with whatever the other ranks do next, nonblocking: start announcing that this rank exits.

        The other ranks' next agreement completes with this rank's "leaving"
        mark and raises :class:`~mpidist.RankLeftError` naming it. Ranks that
        all leave together simply agree to leave. Returns whether the
        announcement started (not on an unusable communicator, nor with
        agreement off); :meth:`finish_leaving` waits for it, so that a rank
        leaves all its communicators at once, whichever one the others are in.
        """
        t = self.transport
        if t.broken is not None or not self.enabled:
            return False
        if self._pending is not None:
            self._pending.wait()
        t.begin()
        send = self._send
        send[:] = 0.0
        self._carried = 0
        self._flags, self._mine, self._mark = _CLEAR, (), _CLEAR
        t.recent = (t.seq, None, None, None, None)
        r = float(t.rank + 1)
        send[_LEAVING], send[_LEFT1], send[_LEFT2] = 1.0, r, r * r
        t.call("agreement", self.request.Start)
        return True

    def finish_leaving(self) -> None:
        """Local: wait (under the deadline) until the other ranks took in this rank's departure (:meth:`leave`)."""
        t = self.transport
        t.poll(self.request, "exit of this rank (waiting for the other ranks to reach their next collective)")
        t.broken = "this rank left the job"

    # -- verification -------------------------------------------------------------------------
    def _identity(self, call: Call, carry: int) -> tuple[tuple[float, ...], list[float]]:
        """This call's hash words with their squares, and what their sums are when every rank agrees."""
        key = (call.key, carry)
        found = self._hashes.get(key)
        if found is None:
            if len(self._hashes) > 4096:
                self._hashes.clear()
                self._sites.clear()
            digest = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=16).digest(), "little")
            mask = (1 << self._bits) - 1
            words = [float((digest >> (k * self._bits)) & mask) for k in range(_K)]
            mine = tuple(x for w in words for x in (w, w * w))
            n = self.transport.size
            found = (mine, [n * x for x in mine])
            self._hashes[key] = found
            self._sites[mine] = caller()
        return found

    def _verify(
        self, call: Call, error: Optional[Exception], carry: int, expected: list[float]
    ) -> Optional[np.ndarray]:
        """Local: the verdict on the summed records, the same on every rank; the carried sums when agreed."""
        t = self.transport
        tail = self._tail.tolist()
        n, s = t.size, self._stamp()
        if tail[11:] == expected and tail[9] == n * s and tail[10] == n * s * s and not any(tail[:9]):
            return self._recv[:carry] if carry else None  # the common case
        bad, nonfinite, leaving, left1, left2, stop = tail[:6]
        if stop:
            self.stop_agreed = True
        if leaving:
            t.broken = "a rank left the job"
            raise RankLeftError(
                _left_message(t.rank, int(leaving), left1, left2, call.describe(), t.seq),
                named_ranks(int(leaving), left1, left2),
            )
        if bad or not (tail[11:] == expected and tail[9] == n * s and tail[10] == n * s * s):
            self._mismatch(call, error, carry)
        # _FAULT: how many ranks have fault tolerance on (a creation names the option itself, above)
        if tail[6] != self._agreed_tail[6]:
            raise CollectiveMismatchError(
                on_rank(
                    t.rank,
                    f"{int(tail[6])} of {n} ranks have fault_tolerance on in collective #{t.seq} "
                    f"({call.describe()}); it must be on or off on every rank alike (MPIDIST_FAULT_TOLERANCE); "
                    "no array was modified.",
                )
            )
        if nonfinite:
            self._nonfinite(call)
        return self._recv[:carry] if carry else None

    def _mismatch(self, call: Call, error: Optional[Exception], carry: int) -> None:
        t = self.transport
        if error is not None:
            mine = f"could not take part: {type(error).__name__}: {error}"
        else:
            mine = "\n".join([call.describe(), *call.layout()])
        steps = f" after {self.input_steps} input steps" if self.input_steps else ""
        if self.steps_left:
            many = self.steps_left > 1
            steps += f" after leaving {self.steps_left} step{'s' if many else ''} by an exception ({self._last_left})"
        head, *layout = mine.split("\n")
        site = call_site()
        texts = gather_texts(
            t, "agreement details", "\n".join([f"#{t.seq}{steps} {head}{_at(site)}", *layout, f"carried {carry}"])
        )
        carries = {r: text.rsplit("\n", 1)[1] for r, text in enumerate(texts)}
        texts = [text.rsplit("\n", 1)[0] for text in texts]
        heads = {r: text.split("\n", 1)[0] for r, text in enumerate(texts)}
        lines = group_ranks(heads, things="calls")
        layouts = [text.split("\n")[1:] for text in texts]
        if error is not None:
            raise error
        if len(set(carries.values())) > 1 and len({_SITE.sub("", text) for text in texts}) == 1:
            # alike calls: only where the data is differs (a small host array travels in the record, carried)
            places = {r: "host memory" if c != "carried 0" else "device memory" for r, c in carries.items()}
            raise CollectiveMismatchError(
                on_rank(
                    t.rank,
                    f"ranks disagree on where the data of collective #{t.seq} ({call.describe()}) is: "
                    f"{group_ranks(places, things='places')}. A collective's arrays must be on the device on "
                    "every rank or on the host on every rank (the same device= on every rank); no array was modified.",
                ),
                heads,
            )
        if call.kind == Kind.CREATE and not any("could not take part" in text for text in heads.values()):
            raise CollectiveMismatchError(
                on_rank(
                    t.rank,
                    f"ranks disagree on the options of {call.name}: {_option_differences(layouts)}. These "
                    "options shape the collectives and must be the same on every rank (set them alike, or "
                    "leave the MPIDIST_* variables alike on every node); see docs/collective-safety.md.",
                ),
                heads,
            )
        if _input_steps_differ(texts):
            raise CollectiveMismatchError(
                on_rank(
                    t.rank,
                    f"ranks drew different numbers of steps from their input before collective #{t.seq} "
                    f"({call.describe()}): {group_ranks({r: f'{_input_steps(h)} steps' for r, h in heads.items()})}. "
                    "Every rank must call next() on its mpidist input iterators the same number of times (a rank "
                    "that skipped or repeated a step would pair its data with another step's); no array was "
                    "modified.",
                ),
                heads,
            )
        if not any(text.split(" ", 1)[1].startswith("could not take part") for text in heads.values()):
            lines += _first_difference(layouts)
        raise CollectiveMismatchError(
            on_rank(
                t.rank,
                f"ranks disagree on collective #{t.seq} ({call.describe()}): {lines}. Every rank "
                "must call the same collectives in the same order, with arrays of the same dtype and shape and "
                "the same names, nests of the same structure and the same updates; no array was modified.",
            ),
            heads,
        )

    def _nonfinite(self, call: Call) -> None:
        t = self.transport
        flags = gather_texts(t, "agreement details", "1" if self._send[_NONFINITE] else "0")
        ranks = [r for r, f in enumerate(flags) if f == "1"]
        raise NonFiniteError(
            on_rank(
                t.rank,
                f"{call.describe()}: rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} "
                "contributed NaN or Inf; nothing was reduced, so the other replicas keep finite values. Find "
                "where the non-finite values come from (learning rate, loss scale, bad input), or turn the "
                "guard off with check_finite=False.",
            ),
            ranks,
        )


def _input_steps(text: str) -> int:
    """The input steps in a rank's description of its call (``#seq[ after N input steps] call``)."""
    found = re.match(r"#\d+ after (\d+) input steps ", text)
    return int(found.group(1)) if found else 0


def _input_steps_differ(texts: list[str]) -> bool:
    """Whether the ranks' descriptions differ in the input steps, and in nothing else (their call sites aside)."""
    calls = {re.sub(_SITE, "", re.sub(r"^(#\d+)( after \d+ input steps)? ", r"\1 ", text), count=1) for text in texts}
    return len(calls) == 1 and len({_input_steps(text) for text in texts}) > 1


_SITE = re.compile(r" at [^\n]*:\d+$", re.MULTILINE)  # the call site ending the first line of a description


def _at(site: str) -> str:
    """`` at train.py:88`` (nothing without a site)."""
    return f" at {site}" if site else ""


def _nonfinite(data: CallData) -> bool:
    if data is None:
        return False
    arrays = data if isinstance(data, (list, tuple)) else [data]
    return any(a.dtype.char in FLOATS and not bool(array_module(a).isfinite(a).all()) for a in arrays)


def _first_difference(layouts: list[list[str]]) -> str:
    """For fused reductions: the first array whose description differs between ranks."""
    if not any(layouts):
        return ""
    for i in range(max(len(rows) for rows in layouts)):
        column = {r: rows[i] if i < len(rows) else "(no such array)" for r, rows in enumerate(layouts)}
        if len(set(column.values())) > 1:
            return f"; first difference at array #{i}: {group_ranks(column, things='calls')}"
    return ""


def _option_differences(layouts: list[list[str]]) -> str:
    """For a creation: each option whose ``name=value`` line differs between ranks, with each rank's value."""
    differences = []
    for i in range(max(len(rows) for rows in layouts)):
        column = {r: rows[i] if i < len(rows) else "?" for r, rows in enumerate(layouts)}
        if len(set(column.values())) > 1:
            option = next(iter(column.values())).split("=", 1)[0]
            values = {r: line.split("=", 1)[-1] for r, line in column.items()}
            differences.append(f"{option} ({group_ranks(values, things='values').replace('; ', ', ')})")
    return "; ".join(differences)


def _left_message(rank: int, count: int, s1: float, s2: float, what: str, seq: int) -> str:
    ranks = named_ranks(count, s1, s2)
    who = f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}" if ranks else f"{count} ranks"
    return on_rank(
        rank,
        f"{who} left the job (the script returned or called sys.exit) while this rank "
        f"entered collective #{seq} ({what}); every rank must make the same collective calls, so "
        "the ranks that stay cannot go on. Make every rank run the same steps, or end all ranks "
        "together.",
    )


def leave_all() -> None:
    """At exit, on every communicator not freed: complete the handles still in flight (in creation order), then
    announce this rank's exit on all of them at once (an exit hook calls this; collective with the other ranks'
    next step).

    Errors are not raised: a deadline error among them sets the exit status (see :mod:`~mpidist._comm.abort`).
    """
    live = list(_live)
    for agreement in live:
        try:
            agreement.transport.complete_handles()
        except (MpidistError, MPI.Exception):
            pass
    leaving = []
    for agreement in live:  # on every communicator at once: another rank may wait in any of them
        try:
            if agreement.leave():
                leaving.append(agreement)
        except (MpidistError, MPI.Exception):
            pass
    for agreement in leaving:
        try:
            agreement.finish_leaving()
        except (MpidistError, MPI.Exception):
            pass
