"""The command line: ``python -m mpidist COMMAND ...``.

Each command is one function decorated with :func:`command`; it receives the
``add_subparsers()`` object, adds its own parser (with ``--help`` text for
every option) and sets ``handler`` to a function ``(args) -> exit status``.
Commands import what they need inside their handlers, so ``--help`` stays fast.
Adding a command is adding one decorated function; nothing else changes.

Exit statuses: 0 success, 1 the command found a problem (e.g. a checksum
failed), 2 usage errors or a missing/unreadable input.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Optional, Sequence

__all__ = ["build_parser", "command", "main"]

_COMMANDS: list[Callable[[Any], None]] = []


def command(add: Callable[[Any], None]) -> Callable[[Any], None]:
    """Register ``add(subparsers)``, which adds one command's parser and its ``handler``."""
    _COMMANDS.append(add)
    return add


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


def _add_module_command(subparsers: Any, name: str, module: Any, help: str) -> None:
    """Register a command whose module offers ``DESCRIPTION``, ``add_arguments`` and ``run``."""
    parser = subparsers.add_parser(name, help=help, description=module.DESCRIPTION)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)


# -- doctor ----------------------------------------------------------------------------------
@command
def _add_doctor(subparsers: Any) -> None:
    from mpidist._tools import doctor as _doctor

    _add_module_command(subparsers, "doctor", _doctor,
                        "report how an MPI job is set up (launcher, ranks per node, GPUs, CUDA-aware MPI) and "
                        "what to fix; run it under your launcher")


# -- bench -----------------------------------------------------------------------------------
@command
def _add_bench(subparsers: Any) -> None:
    from mpidist._tools import bench as _bench

    _add_module_command(subparsers, "bench", _bench,
                        "measure mpidist's collectives against raw mpi4py (and torch gloo); run it under mpiexec")


# -- checkpoint ------------------------------------------------------------------------------
@command
def _add_checkpoint(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="inspect checkpoints written by mpidist.Checkpoint",
        description="Tools for checkpoint directories written by mpidist.Checkpoint.save. They read files only: "
                    "no MPI job is needed, and nothing in a checkpoint is ever unpickled or executed.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect", help="list a save's contents and verify its checksums",
        description="List the names, kinds, shapes, dtypes and aggregations of a save, the number of ranks that "
                    "wrote it, and verify the CRC-32 checksum of every file. Exit status: 0 when everything "
                    "verifies, 1 when a file is damaged (each damaged file is named), 2 when PATH holds no "
                    "checkpoint.")
    inspect.add_argument("path", metavar="PATH",
                         help="a checkpoint directory (its newest save is inspected) or one save inside it, "
                              "e.g. PATH/ckpt-000003")
    inspect.add_argument("--all", action="store_true",
                         help="inspect every save kept in the checkpoint directory, oldest first, not only the newest")
    inspect.add_argument("--no-verify", action="store_true",
                         help="only list the manifest; do not read the data to verify checksums (fast)")
    inspect.add_argument("--json", action="store_true",
                         help="print one JSON object per save (directory, manifest, problems) instead of a table")
    inspect.set_defaults(handler=_checkpoint_inspect)


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mpidist._checkpoint import format as fmt
    from mpidist._errors import CheckpointError

    try:
        if args.all and not (Path(args.path) / fmt.MANIFEST).is_file():
            targets = fmt.list_versions(args.path) or [fmt.resolve(args.path)]
        else:
            targets = [fmt.resolve(args.path)]
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = 0
    for target in targets:
        try:
            report = fmt.inspect(target, verify=not args.no_verify)
        except CheckpointError as exc:  # the manifest itself is damaged
            print(f"{target}: DAMAGED: {exc}", file=sys.stderr)
            status = 1
            continue
        if args.json:
            print(json.dumps({"directory": str(report.directory), "ok": report.ok, "verified": report.verified,
                              "problems": report.problems, "manifest": report.manifest}))
        else:
            _print_report(report)
        status = status or (0 if report.ok else 1)
    return status


def _print_report(report: Any) -> None:
    from mpidist._checkpoint import format as fmt

    manifest = report.manifest
    print(f"checkpoint {report.directory}")
    print(f"  saved {manifest['created']} by mpidist {manifest['mpidist_version']} on {manifest['world_size']} "
          f"rank{'s' if manifest['world_size'] != 1 else ''}; format {manifest['format_version']}; "
          f"{manifest['checksum']} per {fmt.human_size(manifest['chunk_bytes'])} chunk")
    rows = [fmt.describe_entry(e) for e in manifest["entries"]]
    columns = ["name", "kind", "shape", "dtype", "aggregation", "size"]
    for row in rows:
        row["status"] = ("DAMAGED" if row["name"] in report.problems
                         else "ok" if report.verified and row["kind"] != fmt.STATE else "")
    columns.append("status")
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in columns}
    print("  " + "  ".join(c.ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  " + "  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())
    arrays = [e for e in manifest["entries"] if e["kind"] in fmt.ARRAY_KINDS]
    total = fmt.human_size(sum(e["nbytes"] for e in arrays))
    if not report.verified:
        print(f"  not verified (--no-verify): {len(arrays)} arrays, {total}")
    elif report.ok:
        print(f"  verified: {len(arrays)} arrays, {total}, every checksum matches")
    else:
        print(f"  DAMAGED: {len(report.problems)} of {len(arrays)} arrays fail verification:")
        for problem in report.problems.values():
            print(f"    {problem}")
