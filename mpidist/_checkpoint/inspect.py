"""``python -m mpidist checkpoint inspect``: list a save and verify it, without MPI. Local.

Exit statuses: 0 everything checked is fine, 1 damaged data (a checksum or a
size does not match), 3 a malformed or unreadable save (no save at the path,
a manifest a reader refuses, a link, FIFO or device inside the save, an
I/O error). Every problem is reported on one line, never as a traceback, and
characters that are not printable (in names, paths, messages) are escaped.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from argparse import _SubParsersAction  # what add_subparsers() returns (argparse has no public name for it)

__all__ = ["DAMAGED", "DESCRIPTION", "OK", "UNREADABLE", "add_parser", "printable", "run"]

OK, DAMAGED, UNREADABLE = 0, 1, 3

DESCRIPTION = (
    "List the names, kinds, shapes, dtypes and aggregations of a save, the number of ranks that wrote "
    "it, and verify the CRC-32 checksum of every file. Exit status: 0 when everything verifies, 1 when "
    "data is damaged (a checksum or size does not match; each damaged file is named), 3 when the save "
    "is malformed or unreadable (no save at PATH, a manifest mpidist refuses, a link, FIFO or device "
    "inside the save)."
)


def add_parser(actions: _SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``inspect`` action to the ``checkpoint`` command's ``add_subparsers()`` object."""
    parser = actions.add_parser(
        "inspect", help="list a save's contents and verify its checksums", description=DESCRIPTION
    )
    parser.add_argument(
        "path",
        metavar="PATH",
        help="a checkpoint directory (its newest save is inspected) or one save inside it, e.g. PATH/ckpt-000003",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="inspect every save kept in the checkpoint directory, oldest first, not only the newest",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="do not read the data to verify its checksums (fast); the manifest and each data "
        "file's type, size and header are still checked",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per save (directory, status, problems, manifest) instead of a table",
    )
    parser.set_defaults(handler=run)


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped as in a Python string literal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def run(args: argparse.Namespace) -> int:
    """Inspect the save(s) at ``args.path``; print the report; return the exit status."""
    from pathlib import Path

    from mpidist._checkpoint import format as fmt

    try:
        targets: list[Any] = [args.path]
        if args.all and not Path(args.path, fmt.MANIFEST).exists():
            targets = fmt.list_versions(args.path) or targets
    except Exception as exc:  # any failure is reported on one line, never as a traceback
        return _fail(args, args.path, exc)
    status = OK
    for target in targets:
        status = max(status, _inspect_one(args, target))
    return status


def _inspect_one(args: argparse.Namespace, target: Any) -> int:
    from mpidist._checkpoint.reader import inspect

    try:
        report = inspect(target, verify=not args.no_verify)
    except Exception as exc:  # MemoryError, RecursionError, OSError too: one line each
        return _fail(args, target, exc)
    if args.json:
        print(
            json.dumps(
                {
                    "directory": str(report.directory),
                    "ok": report.ok,
                    "status": report.status,
                    "verified": report.verified,
                    "problems": report.problems,
                    "manifest": report.manifest,
                }
            )
        )
    else:
        _print_report(report)
    return report.status


def _fail(args: argparse.Namespace, target: Any, exc: BaseException) -> int:
    from mpidist._errors import ChecksumError

    status = DAMAGED if isinstance(exc, ChecksumError) else UNREADABLE
    what = "DAMAGED" if status == DAMAGED else "UNREADABLE"
    reason = (
        str(exc)
        if isinstance(exc, (OSError, ValueError, RuntimeError)) and str(exc)
        else f"{type(exc).__name__}: {exc}"
    )
    if args.json:
        print(json.dumps({"directory": str(target), "ok": False, "status": status, "error": reason}))
    print(printable(f"{target}: {what}: {reason}"), file=sys.stderr)
    return status


def _print_report(report: Any) -> None:
    from mpidist._checkpoint import format as fmt
    from mpidist._units import human_size

    manifest = report.manifest
    print(printable(f"checkpoint {report.directory}"))
    print(
        printable(
            f"  saved {manifest['created']} by mpidist {manifest['mpidist_version']} on "
            f"{manifest['world_size']} rank{'s' if manifest['world_size'] != 1 else ''}; format "
            f"{manifest['format_version']}; {manifest['checksum']} per "
            f"{human_size(manifest[fmt.BLOCK_BYTES_KEY])} block"
        )
    )
    rows = [{k: printable(v) for k, v in fmt.describe_entry(e).items()} for e in manifest["entries"]]
    failed = "DAMAGED" if report.status == DAMAGED else "UNREADABLE"
    for entry, row in zip(manifest["entries"], rows):
        row["status"] = failed if entry["name"] in report.problems else "ok" if entry["kind"] != fmt.STATE else ""
    columns = ["name", "kind", "shape", "dtype", "aggregation", "size", "status"]
    # A state's summary (up to 40 characters) runs past the size column instead of widening it:
    # the row's status is empty (only arrays are verified), so nothing follows it.
    sized = [r for r, e in zip(rows, manifest["entries"]) if e["kind"] != fmt.STATE]
    widths = {c: max([len(c)] + [len(r[c]) for r in (sized if c == "size" else rows)]) for c in columns}
    print("  " + "  ".join(c.ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  " + "  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())
    arrays = [e for e in manifest["entries"] if e["kind"] in fmt.ARRAY_KINDS]
    total = human_size(sum(e["nbytes"] for e in arrays))
    if report.ok and report.verified:
        print(f"  verified: {len(arrays)} arrays, {total}, every checksum matches")
    elif report.ok:
        print(f"  not verified (--no-verify): {len(arrays)} arrays, {total}; file types, sizes and headers match")
    else:
        print(f"  {failed}: {len(report.problems)} of {len(arrays)} arrays fail verification:")
        for problem in report.problems.values():
            print(printable(f"    {problem}"))
