"""Validated configuration: keyword options over ``MPIDIST_*`` environment variables.

Precedence: an explicit keyword argument, then the environment variable, then
the default. Unknown keywords and malformed values raise ``ValueError`` naming
the option and the accepted values, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

__all__ = ["COMPRESSIONS", "Options"]

_MIB = 1 << 20
_PIECE_BYTES = 2 * _MIB
COMPRESSIONS = ("fp16", "bf16")  # the wire encodings of compressed float32 reductions
# Options renamed since they were released: new name -> former name (which keeps working, and warns).
_FORMER = {"piece_bytes": "pipeline_bytes"}


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected one of 1/0, true/false, yes/no, on/off, got {text!r}")


def _parse_auto_bool(text: str) -> Optional[bool]:
    """A boolean, or ``None`` for ``auto`` (mpidist decides)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _parse_bool(text)
    except ValueError:
        raise ValueError(f"expected auto or one of 1/0, true/false, yes/no, on/off, got {text!r}") from None


def _parse_seconds(text: str) -> Optional[float]:
    low = text.strip().lower()
    if low in ("", "none", "off"):
        return None
    value = float(low)
    return None if value == 0 else value


def _parse_compression(text: str) -> Optional[str]:
    """``fp16`` or ``bf16``; ``None`` for ``none`` (or nothing): exact reductions."""
    low = text.strip().lower()
    if low in ("", "none"):
        return None
    if low not in COMPRESSIONS:
        raise ValueError(f"expected none, fp16 or bf16, got {text!r}")
    return low


def _parse_directory(text: str) -> Optional[str]:
    return text.strip() or None


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        low = text.strip().lower()
        if low not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return low

    return parse


_PARSERS: dict[str, Callable[[str], Any]] = {
    "timeout": _parse_seconds,
    "check_collectives": _parse_bool,
    "device": _parse_choice("auto", "cpu", "gpu"),
    "cuda_aware": _parse_choice("auto", "1", "0"),
    "piece_bytes": int,
    "check_finite": _parse_bool,
    "check_overflow": _parse_bool,
    "abort_on_error": _parse_bool,
    "check_mirrored_every": int,
    "fusion_bytes": int,
    "hierarchical": _parse_auto_bool,
    "node_size": int,
    "flat_variables": _parse_bool,
    "straggler_threshold": float,
    "straggler_window": int,
    "straggler_interval": _parse_seconds,
    "fault_tolerance": _parse_bool,
    "compression": _parse_compression,
    "timeline": _parse_directory,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Settings of a :class:`~mpidist.MPIStrategy` and its communicator.

    Attributes:
        timeout: seconds a rank waits in a collective for the others before
            raising :class:`~mpidist.CollectiveTimeoutError` naming the ranks
            that have not arrived, with the collective each made last, and
            the ``file:line`` at which every other rank waits; a warning says
            the same halfway (at most a minute in). Default 600: far longer than any healthy collective
            or the imbalance between steps of a training loop, short enough
            that a hung job fails with a diagnosis instead of burning its
            allocation (the same reasoning as NCCL's ten-minute watchdog).
            ``None`` (or 0) waits forever (``MPIDIST_TIMEOUT``).
        check_collectives: before each collective, ranks agree on the call
            (operation, reduce op, dtype, shape, the name of the value) and
            raise :class:`~mpidist.CollectiveMismatchError` on disagreement, and
            an invalid argument on one rank raises on every rank. One small
            fixed-size allreduce per collective, which also carries small
            reductions themselves (``MPIDIST_CHECK``).
        device: ``"cpu"`` (NumPy), ``"gpu"`` (CuPy, one GPU per rank) or
            ``"auto"`` (GPU when CuPy finds one) (``MPIDIST_DEVICE``).
        cuda_aware: whether MPI may be handed GPU buffers: ``"1"``, ``"0"``
            (stage through pinned host memory) or ``"auto"`` (ask MPI, then
            confirm with a one-time self-test) (``MPIDIST_CUDA_AWARE``).
        piece_bytes: reductions of larger buffers run in pieces of this
            many bytes, each reduced by its own MPI call while it is in cache;
            also the size of a fusion bucket. The default, 2 MiB, was the
            fastest piece size for 16-256 MiB buffers on 2-rank shared-memory
            runs (see ``docs/benchmarks.md``) (``MPIDIST_PIECE_BYTES``).
            Formerly ``pipeline_bytes`` (``MPIDIST_PIPELINE_BYTES``), which
            still works and warns (``DeprecationWarning``).
        check_finite: reductions raise :class:`~mpidist.NonFiniteError`
            naming the ranks that contributed NaN/Inf, instead of spreading
            them to every replica; costs one pass over each array
            (``MPIDIST_CHECK_FINITE``).
        check_overflow: integer SUM reductions raise
            :class:`~mpidist.IntegerOverflowError` naming the value and the
            elements whose sum does not fit the dtype, on every rank and
            before anything is written, instead of wrapping around as MPI
            does; costs a reduction of a 64-bit copy (two, for 64-bit
            integers) (``MPIDIST_CHECK_OVERFLOW``).
        abort_on_error: once a strategy exists, an uncaught exception on any
            rank prints its traceback tagged with the rank and aborts the
            whole job, instead of leaving the other ranks waiting
            (``MPIDIST_ABORT_ON_ERROR``).
        check_mirrored_every: compare mirrored variables' checksums across
            ranks after every k-th replica-context update of each (0: never)
            (``MPIDIST_CHECK_MIRRORED_EVERY``).
        fusion_bytes: in a fused reduction of many arrays, arrays (or spans
            of arrays adjacent in memory) of at most this many bytes are
            packed together into reusable buckets of ``piece_bytes``, so
            small arrays never cost one MPI call each; larger ones are
            reduced where they are, in pieces. 0 packs nothing
            (``MPIDIST_FUSION_BYTES``).
        hierarchical: the two-level reduction: within each node over a
            shared-memory communicator, then across nodes between node
            leaders, then a broadcast within the node. ``True`` always,
            ``False`` never (one flat allreduce), ``None`` (the default,
            ``auto``): under Open MPI, when the ranks span more than one
            node and some node holds more than one of them, for each call of
            2 MiB or more (a whole piece, should ``piece_bytes`` be
            smaller), where it beat Open MPI's flat allreduce over 1 Gbit/s
            links (see ``docs/benchmarks.md``); otherwise never. Every input
            of the choice is the same on every rank
            (``MPIDIST_HIERARCHICAL``: ``auto``, or a boolean).
        node_size: ranks per node for ``hierarchical``: 0 finds the
            shared-memory nodes; ``k`` groups every ``k`` consecutive ranks,
            to try the algorithm on one machine (``MPIDIST_NODE_SIZE``).
        flat_variables: mirrored variables live as views of a few large
            buffers (slabs, one series per dtype), so that a fused update of
            many of them is one reduction in pieces, with no packing
            (``MPIDIST_FLAT_VARIABLES``).
        straggler_threshold: rank 0 logs a line naming a rank whose time
            between collectives (outside waiting for the other ranks) is
            persistently at least this fraction above the mean of the other
            ranks': 0.2 is 20% (``MPIDIST_STRAGGLER_THRESHOLD``). Measured
            whenever the ranks agree on their collectives; see
            ``docs/finding-slow-ranks.md``.
        straggler_window: how many of the latest collectives the straggler
            report judges, in stretches of 16: a rank is named when it was that
            much slower in at least half the window's stretches
            (``MPIDIST_STRAGGLER_WINDOW``).
        straggler_interval: at most one straggler line per this many
            seconds; ``None`` (or 0) logs none (``MPIDIST_STRAGGLER_INTERVAL``).
        fault_tolerance: when ranks die (their process or node fails), the
            survivors raise :class:`~mpidist.RankFailedError` naming them and
            carry on over a communicator of the survivors, where the MPI
            library can (Open MPI started with ``--with-ft ulfm``: see
            ``docs/fault-tolerance.md``). Off, a dead rank ends the job (Open
            MPI) or costs the survivors a clear error (``MPIDIST_FAULT_TOLERANCE``).
        compression: ``"fp16"`` or ``"bf16"``: blocking SUM and MEAN
            reductions of float32 cross the wire in 16 bits (half the bytes),
            summed in float32 and rounded once more (see
            ``docs/compression.md`` for the error bound); other dtypes and
            ops, nonblocking reductions, ``reduce_scatter`` and values
            carried inside the agreement record stay exact. ``None`` (or ``"none"``, the
            default): every reduction is exact (``MPIDIST_COMPRESSION``).
            A per-call ``compression=`` overrides it. Across nodes (some
            node holding more than one rank) compressed reductions take the
            two-level algorithm under any MPI, unless ``hierarchical=False``.
        timeline: a directory into which every rank streams a Chrome-trace
            (Perfetto) file of its collectives, with each one's wait for
            the other ranks apart from its transfer, its steps of
            ``strategy.run`` and its input fetches (``timeline-rank<R>.json``);
            ``python -m mpidist timeline DIR`` merges them, aligns the ranks'
            clocks and names the rank the others waited for (see
            ``docs/finding-slow-ranks.md``). ``None`` (the default) records
            nothing and costs nothing. May differ between ranks
            (``MPIDIST_TIMELINE``).
    """

    timeout: Optional[float] = 600.0
    check_collectives: bool = True
    device: str = "auto"
    cuda_aware: str = "auto"
    piece_bytes: int = _PIECE_BYTES
    check_finite: bool = False
    check_overflow: bool = False
    abort_on_error: bool = True
    check_mirrored_every: int = 0
    fusion_bytes: int = 64 * 1024
    hierarchical: Optional[bool] = None
    node_size: int = 0
    flat_variables: bool = False
    straggler_threshold: float = 0.2
    straggler_window: int = 128
    straggler_interval: Optional[float] = 60.0
    fault_tolerance: bool = False
    compression: Optional[str] = None
    timeline: Optional[str] = None
    pipeline_bytes: dataclasses.InitVar[Optional[int]] = None  # the former name of piece_bytes

    def __post_init__(self, pipeline_bytes: Optional[int]) -> None:
        if pipeline_bytes is not None:
            _renamed("option pipeline_bytes", "piece_bytes", stacklevel=4)
            if self.piece_bytes not in (_PIECE_BYTES, pipeline_bytes):
                raise ValueError(
                    f"options piece_bytes and pipeline_bytes (its former name) disagree: "
                    f"{self.piece_bytes!r} and {pipeline_bytes!r}; pass only piece_bytes"
                )
            object.__setattr__(self, "piece_bytes", pipeline_bytes)
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name))
        for name in ("timeout", "straggler_interval"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, None)  # 0 means none, as in MPIDIST_TIMEOUT=0
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(
                    f"option {name} must be a positive number of seconds or None, got {getattr(self, name)!r}"
                )
        if not self.straggler_threshold > 0 or self.straggler_window < 1:
            raise ValueError(
                f"options straggler_threshold and straggler_window must be > 0 and >= 1, "
                f"got {self.straggler_threshold!r} and {self.straggler_window!r}"
            )
        if self.check_mirrored_every < 0:
            raise ValueError(f"option check_mirrored_every must be >= 0, got {self.check_mirrored_every!r}")
        if self.fusion_bytes < 0 or self.node_size < 0:
            raise ValueError(
                f"options fusion_bytes and node_size must be >= 0, got {self.fusion_bytes!r} and {self.node_size!r}"
            )
        if self.timeline == "":
            raise ValueError("option timeline must name a directory (or be None for no timeline), got ''")
        if self.piece_bytes < 1024:
            raise ValueError(f"option piece_bytes must be at least 1024, got {self.piece_bytes!r}")
        for name in ("device", "cuda_aware"):
            _PARSERS[name](str(getattr(self, name)))
        if self.compression is not None:
            try:
                object.__setattr__(self, "compression", _parse_compression(self.compression))
            except ValueError as exc:
                raise ValueError(f"option compression: {exc}") from None

    @classmethod
    def resolve(cls, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> Options:
        """Build options from keyword overrides, then ``MPIDIST_*`` variables, then defaults."""
        env = os.environ if env is None else env
        fields = {f.name for f in dataclasses.fields(cls)}
        _warn_misspelt(env, fields)
        overrides = _new_names(overrides)
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown mpidist option(s) {', '.join(unknown)}; known options: {', '.join(sorted(fields))}"
            )
        values: dict[str, Any] = {}
        for name in fields:
            if name in overrides:
                value = overrides[name]
                # keywords are typed values; only the two text-valued options take (and normalise) text
                text = isinstance(value, str) and name in ("device", "cuda_aware")
                values[name] = _PARSERS[name](value) if text else value
                if name == "timeline" and isinstance(value, os.PathLike):  # a pathlib.Path, say
                    values[name] = os.fspath(value)
                continue
            var = _env_variable(env, name)
            if var is not None:
                try:
                    values[name] = _PARSERS[name](env[var])
                except ValueError as exc:
                    raise ValueError(f"environment variable {var}: {exc}") from None
        return cls(**values)


# The types each option accepts (bool is not a number here; None only where it means "off").
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "timeout": ((int, float, type(None)), "a number of seconds or None"),
    "check_collectives": ((bool,), "True or False"),
    "device": ((str,), '"auto", "cpu" or "gpu"'),
    "cuda_aware": ((str,), '"auto", "1" or "0"'),
    "piece_bytes": ((int,), "an integer number of bytes"),
    "check_finite": ((bool,), "True or False"),
    "check_overflow": ((bool,), "True or False"),
    "abort_on_error": ((bool,), "True or False"),
    "check_mirrored_every": ((int,), "an integer"),
    "fusion_bytes": ((int,), "an integer number of bytes"),
    "hierarchical": ((bool, type(None)), "True, False or None (auto)"),
    "node_size": ((int,), "an integer"),
    "flat_variables": ((bool,), "True or False"),
    "straggler_threshold": ((int, float), "a number (0.2 is 20%)"),
    "straggler_window": ((int,), "an integer number of collectives"),
    "straggler_interval": ((int, float, type(None)), "a number of seconds or None"),
    "fault_tolerance": ((bool,), "True or False"),
    "compression": ((str, type(None)), '"fp16", "bf16", "none" or None'),
    "timeline": ((str, type(None)), "a directory (str or path) or None"),
}

# MPIDIST_* variables of the project's own scripts and tests, which are not options.
_NOT_OPTIONS = (
    "MPIDIST_TEST_",
    "MPIDIST_SLURM_",
    "MPIDIST_MPIEXEC",
    "MPIDIST_LAUNCHER",
    "MPIDIST_SRUN_MPI",
    "MPIDIST_REGROW",
    "MPIDIST_FINISHED_DIR",
    "MPIDIST_VENV",
    "MPIDIST_JOBS",
    "MPIDIST_PYTEST_ARGS",
    "MPIDIST_MPI_ENV",
    "MPIDIST_CTEST_",
)
_warned: set[str] = set()


def _check_type(name: str, value: Any) -> None:
    types, expected = _TYPES[name]
    integral = isinstance(value, int) and not isinstance(value, bool)
    if (
        (bool not in types and isinstance(value, bool))
        or not isinstance(value, types)
        or (int in types and float not in types and not integral)
    ):
        raise TypeError(f"option {name} must be {expected}, got {value!r} ({type(value).__name__})")


def _new_names(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with former option names replaced by the current ones (with a deprecation warning)."""
    for new, old in _FORMER.items():
        if old in overrides:
            _renamed(f"option {old}", new, stacklevel=4)
            if new in overrides:
                raise ValueError(f"options {new} and {old} (its former name) were both given; pass only {new}")
            overrides = {**overrides, new: overrides[old]}
            del overrides[old]
    return overrides


def _env_variable(env: Mapping[str, str], name: str) -> Optional[str]:
    """The variable of ``env`` that sets option ``name``: its own, else its former one, else None.

    A former variable that is set warns (also when the current one overrides it).
    """
    var = _env_name(name)
    old = _env_name(_FORMER[name]) if name in _FORMER else None
    if old is not None and old in env:
        _renamed(f"environment variable {old}", var, stacklevel=4)
        if var not in env:
            return old
    return var if var in env else None


def _renamed(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} is deprecated: it was renamed {new}", DeprecationWarning, stacklevel=stacklevel)


def _pipeline_bytes(self: Options) -> int:
    """The former name of :attr:`Options.piece_bytes` (deprecated)."""
    _renamed("Options.pipeline_bytes", "piece_bytes", stacklevel=3)
    return self.piece_bytes


Options.pipeline_bytes = property(_pipeline_bytes)  # type: ignore[attr-defined]  # replaces the InitVar's default


def _env_name(option: str) -> str:
    return "MPIDIST_" + ("CHECK" if option == "check_collectives" else option.upper())


def _warn_misspelt(env: Mapping[str, str], fields: set[str]) -> None:
    """Warn once per variable about ``MPIDIST_*`` names that look like a misspelt option."""
    known = {_env_name(f): f for f in [*fields, *_FORMER.values()]}
    for var in env:
        if not var.startswith("MPIDIST_") or var in known or var in _warned or var.startswith(_NOT_OPTIONS):
            continue
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.8)
        if close:
            _warned.add(var)
            warnings.warn(
                f"environment variable {var} is not an mpidist option; did you mean {close[0]}?",
                UserWarning,
                stacklevel=4,
            )
