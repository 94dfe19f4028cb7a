"""Did every rank succeed? The failure exchange shared by the communicator and the agreement.

The question is asked in two steps. First every rank contributes one flag
("failed here") to one small reduction, the common case and the only cost
when every rank succeeded (the :class:`~mpidist.Communicator` runs it, see
:meth:`~mpidist.Communicator.outcome`). Only when some rank failed do the
ranks exchange their texts (:func:`gather_failures`, over the transport's raw
byte gather: no agreement record, nothing pickled), so that every rank can
name the ranks that failed and why. The agreement's own error path (a rank's
invalid argument, ranks that disagree) gathers its per-rank texts with the
same exchange (:func:`gather_texts`).

:func:`describe_failures` and :func:`group_ranks` put such per-rank texts
into one line, ranks with the same text grouped; both are local.
"""

from __future__ import annotations

from typing import Union

from mpidist._comm.transport import Transport
from mpidist._errors import format_ranks

__all__ = ["Failures", "describe_failures", "gather_failures", "gather_texts", "group_ranks"]

Failures = dict[int, Union[BaseException, str]]


def failure_text(error: BaseException) -> str:
    """Local: ``"ExceptionType: message"``, how a failure travels to the other ranks."""
    return f"{type(error).__name__}: {error}"


def gather_texts(transport: Transport, what: str, text: str) -> list[str]:
    """Collective (error paths): every rank's ``text``, in rank order.

    Two raw MPI calls under the deadline (lengths, then the UTF-8 bytes),
    within the collective the caller has numbered.
    """
    data = text.encode(errors="replace")
    return [b.decode(errors="replace") for b in transport.allgather_bytes(what, data)]


def gather_failures(transport: Transport, error: BaseException | None, what: str) -> Failures:
    """Collective, once the ranks know that some rank failed: ``{rank: what failed there}`` for each failed rank.

    This rank's own entry is ``error`` itself; the others' are their
    :func:`failure_text` strings. The keys are the same on every rank.
    """
    texts = gather_texts(transport, what, "" if error is None else failure_text(error))
    rank = transport.rank
    return {r: error if r == rank and error is not None else text for r, text in enumerate(texts) if text}


def describe_failures(failures: Failures) -> str:
    """Local: ``"ranks 0-1: ValueError: x; rank 3: OSError: y"``, ranks with the same failure grouped.

    Exceptions are written as :func:`failure_text`, so every rank writes the
    same line for the same ``failures``.
    """
    texts = {r: f if isinstance(f, str) else failure_text(f) for r, f in sorted(failures.items())}
    return group_ranks(texts, things="failures")


def group_ranks(texts: dict[int, str], limit: int = 2000, things: str = "texts") -> str:
    """Local: ``"ranks 0, 2: text; rank 1: other"``: ranks grouped by identical text, every distinct text kept
    (the length capped at about ``limit`` characters, ending with how many ``things`` there were)."""
    groups: dict[str, list[int]] = {}
    for r, text in texts.items():
        groups.setdefault(text, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)}: {text}" for text, rs in groups.items()]
    out = "; ".join(parts)
    if len(out) > limit:
        out = out[:limit].rsplit("; ", 1)[0] + f"; ... ({len(groups)} different {things} in all)"
    return out
