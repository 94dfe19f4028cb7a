"""The command line: ``python -m mpidist COMMAND ...``.

Each command is one function decorated with :func:`command`; it receives the
``add_subparsers()`` object, adds its own parser (with ``--help`` text for
every option) and sets ``handler`` to a function ``(args) -> exit status``.
Commands import what they need inside their handlers, so ``--help`` stays fast.
Adding a command is adding one decorated function; nothing else changes.

Exit statuses: 0 success, 1 the command found a problem (e.g. a checksum
failed), 2 usage errors; a command's help lists any others (``checkpoint
inspect``: 3 for a malformed or unreadable save).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from argparse import _SubParsersAction  # what add_subparsers() returns (argparse has no public name for it)

    Subparsers = _SubParsersAction[argparse.ArgumentParser]

__all__ = ["build_parser", "command", "main", "positive_int", "positive_seconds"]

_COMMANDS: list[Callable[[Subparsers], None]] = []


def command(add: Callable[[Subparsers], None]) -> Callable[[Subparsers], None]:
    """Register ``add(subparsers)``, which adds one command's parser and its ``handler``."""
    _COMMANDS.append(add)
    return add


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1 (otherwise a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds above 0 (otherwise a one-line usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds above 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m mpidist`` parser with every registered command."""
    from mpidist._version import __version__

    parser = argparse.ArgumentParser(
        prog="python -m mpidist",
        description="mpidist command-line tools. Run `python -m mpidist COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"mpidist {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


def _add_module_command(subparsers: Subparsers, name: str, module: ModuleType, help: str) -> None:
    """Register a command whose module offers ``DESCRIPTION``, ``add_arguments`` and ``run``."""
    parser = subparsers.add_parser(name, help=help, description=module.DESCRIPTION)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)


# -- doctor ----------------------------------------------------------------------------------
@command
def _add_doctor(subparsers: Subparsers) -> None:
    from mpidist._tools import doctor as _doctor

    _add_module_command(
        subparsers,
        "doctor",
        _doctor,
        "report how an MPI job is set up (launcher, ranks per node, GPUs, CUDA-aware MPI) and "
        "what to fix; run it under your launcher",
    )


# -- bench -----------------------------------------------------------------------------------
@command
def _add_bench(subparsers: Subparsers) -> None:
    from mpidist._tools import bench as _bench

    _add_module_command(
        subparsers,
        "bench",
        _bench,
        "measure mpidist's collectives against raw mpi4py (and torch gloo); run it under mpiexec",
    )


# -- checkpoint ------------------------------------------------------------------------------
@command
def _add_checkpoint(subparsers: Subparsers) -> None:
    from mpidist._checkpoint import inspect as _inspect

    parser = subparsers.add_parser(
        "checkpoint",
        help="inspect checkpoints written by mpidist.Checkpoint",
        description="Tools for checkpoint directories written by mpidist.Checkpoint.save. They read files only: "
        "no MPI job is needed, and nothing in a checkpoint is ever unpickled or executed.",
    )
    _inspect.add_parser(parser.add_subparsers(dest="action", metavar="ACTION", required=True))


# -- timeline --------------------------------------------------------------------------------
@command
def _add_timeline(subparsers: Subparsers) -> None:
    from mpidist._tools import timeline as _timeline

    _add_module_command(
        subparsers,
        "timeline",
        _timeline,
        "merge the per-rank timeline files of a job run with MPIDIST_TIMELINE=DIR: align the clocks, "
        "show where each rank waited and which rank the others waited for",
    )
