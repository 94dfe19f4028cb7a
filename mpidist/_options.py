"""Validated configuration: keyword options over ``MPIDIST_*`` environment variables.

Precedence: an explicit keyword argument, then the environment variable, then
the default. Unknown keywords and malformed values raise ``ValueError`` naming
the option and the accepted values, so a typo never silently does nothing.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional

__all__ = ["Options"]

_MIB = 1 << 20


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected one of 1/0, true/false, yes/no, on/off, got {text!r}")


def _parse_timeout(text: str) -> Optional[float]:
    low = text.strip().lower()
    if low in ("", "none", "0", "off"):
        return None
    return float(low)


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        low = text.strip().lower()
        if low not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return low

    return parse


_PARSERS: dict[str, Callable[[str], Any]] = {
    "timeout": _parse_timeout,
    "check_collectives": _parse_bool,
    "device": _parse_choice("auto", "cpu", "gpu"),
    "cuda_aware": _parse_choice("auto", "1", "0"),
    "pipeline_bytes": int,
    "check_finite": _parse_bool,
    "abort_on_error": _parse_bool,
    "check_mirrored_every": int,
    "fusion_bytes": int,
    "hierarchical": _parse_bool,
    "node_size": int,
    "flat_variables": _parse_bool,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Settings of a :class:`~mpidist.MPIStrategy` and its communicator.

    Attributes:
        timeout: seconds a rank waits for the others to join a collective
            before raising :class:`~mpidist.CollectiveTimeoutError`; ``None``
            waits forever (``MPIDIST_TIMEOUT``).
        check_collectives: before each collective, ranks agree on operation,
            shape, dtype and reduce op, and raise
            :class:`~mpidist.CollectiveMismatchError` on disagreement. Costs one
            small allgather per collective (``MPIDIST_CHECK``).
        device: ``"cpu"`` (NumPy), ``"gpu"`` (CuPy, one GPU per rank) or
            ``"auto"`` (GPU when CuPy finds one) (``MPIDIST_DEVICE``).
        cuda_aware: whether MPI may be handed GPU buffers: ``"1"``, ``"0"``
            (stage through pinned host memory) or ``"auto"`` (ask MPI, then
            confirm with a one-time self-test) (``MPIDIST_CUDA_AWARE``).
        pipeline_bytes: reductions of larger buffers run in pieces of this
            many bytes, which keeps each piece in cache; also the size of a
            fusion bucket. The default, 2 MiB, was the fastest piece size for
            16-256 MiB buffers on 2-rank shared-memory runs (see
            ``docs/benchmarks.md``) (``MPIDIST_PIPELINE_BYTES``).
        check_finite: reductions raise :class:`~mpidist.NonFiniteError`
            naming the ranks that contributed NaN/Inf, instead of spreading
            them to every replica; costs one pass over each array
            (``MPIDIST_CHECK_FINITE``).
        abort_on_error: once a strategy exists, an uncaught exception on any
            rank prints its traceback tagged with the rank and aborts the
            whole job, instead of leaving the other ranks waiting
            (``MPIDIST_ABORT_ON_ERROR``).
        check_mirrored_every: compare mirrored variables' checksums across
            ranks after every k-th replica-context update of each (0: never)
            (``MPIDIST_CHECK_MIRRORED_EVERY``).
        fusion_bytes: in a fused reduction of many arrays, arrays (or runs
            of arrays adjacent in memory) of at most this many bytes are
            packed together into reusable buckets of ``pipeline_bytes``, so
            small arrays never cost one MPI call each; larger ones are
            reduced where they are, in pieces. 0 packs nothing
            (``MPIDIST_FUSION_BYTES``).
        hierarchical: reduce within each node over a shared-memory
            communicator, then across nodes between node leaders, then
            broadcast within the node (``MPIDIST_HIERARCHICAL``).
        node_size: ranks per node for ``hierarchical``: 0 finds the
            shared-memory nodes; ``k`` groups every ``k`` consecutive ranks,
            to try the algorithm on one machine (``MPIDIST_NODE_SIZE``).
        flat_variables: mirrored variables live as views of a few large
            buffers (one series per dtype), so that a fused update of many of
            them is one pipelined reduction with no packing
            (``MPIDIST_FLAT_VARIABLES``).
    """

    timeout: Optional[float] = None
    check_collectives: bool = True
    device: str = "auto"
    cuda_aware: str = "auto"
    pipeline_bytes: int = 2 * _MIB
    check_finite: bool = False
    abort_on_error: bool = True
    check_mirrored_every: int = 0
    fusion_bytes: int = 64 * 1024
    hierarchical: bool = False
    node_size: int = 0
    flat_variables: bool = False

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"option timeout must be a positive number of seconds or None, got {self.timeout!r}")
        if self.check_mirrored_every < 0:
            raise ValueError(f"option check_mirrored_every must be >= 0, got {self.check_mirrored_every!r}")
        if self.fusion_bytes < 0 or self.node_size < 0:
            raise ValueError(f"options fusion_bytes and node_size must be >= 0, got {self.fusion_bytes!r} "
                             f"and {self.node_size!r}")
        if self.pipeline_bytes < 1024:
            raise ValueError(f"option pipeline_bytes must be at least 1024, got {self.pipeline_bytes!r}")
        for name in ("device", "cuda_aware"):
            _PARSERS[name](str(getattr(self, name)))

    @classmethod
    def resolve(cls, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Options":
        """Build options from keyword overrides, then ``MPIDIST_*`` variables, then defaults."""
        env = os.environ if env is None else env
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown mpidist option(s) {', '.join(unknown)}; known options: {', '.join(sorted(fields))}")
        values: dict[str, Any] = {}
        for name in fields:
            var = "MPIDIST_" + ("CHECK" if name == "check_collectives" else name.upper())
            if name in overrides:
                value = overrides[name]
                values[name] = _PARSERS[name](value) if isinstance(value, str) else value
            elif var in env:
                try:
                    values[name] = _PARSERS[name](env[var])
                except ValueError as exc:
                    raise ValueError(f"environment variable {var}: {exc}") from None
        return cls(**values)

    def replace(self, **changes: Any) -> "Options":
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)
