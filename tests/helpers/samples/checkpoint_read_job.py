"""Read crafted checkpoints under a memory limit; run by tests/unit/test_checkpoint_hostile.py.

    python checkpoint_read_job.py LIMIT_BYTES PATH...

After importing mpidist, the address space may grow by at most LIMIT_BYTES
(``RLIMIT_AS``). For each PATH it prints one JSON line: what
``read_checkpoint`` (with and without ``verify``) raised (``null`` if it
returned) and the exit status of ``checkpoint inspect`` (with and without
``--no-verify``). Anything else than a ``CheckpointError``/``FileNotFoundError``
from the reader escapes as a traceback: the test fails on it.
"""

import contextlib
import io
import json
import resource
import sys

from mpidist._checkpoint.reader import read_checkpoint
from mpidist._errors import CheckpointError
from mpidist._tools.cli import main as cli


def vm_size() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def read(path: str, verify: bool):
    try:
        read_checkpoint(path, verify=verify)
    except (CheckpointError, FileNotFoundError) as exc:
        return type(exc).__name__
    return None


def inspect(path: str, *options: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli(["checkpoint", "inspect", *options, path])
    return {"status": status, "output": out.getvalue() + err.getvalue()}


def main(limit: str, *paths: str) -> None:
    budget = vm_size() + int(limit)
    resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
    for path in paths:
        print(
            json.dumps(
                {
                    "path": path,
                    "read": read(path, True),
                    "read_no_verify": read(path, False),
                    "inspect": inspect(path),
                    "inspect_no_verify": inspect(path, "--no-verify"),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
