"""The lint phase: ruff (lint, import order, format) and mypy, as configured in pyproject.toml.

    python tests/helpers/lint.py        # with the test extra installed (it pins ruff and mypy)

CTest runs it as the test ``lint`` (label ``lint``), before the others: it takes seconds.
``tests/run.py --no-lint`` leaves it out. Every tool runs, whatever the others found; the exit
status is 0 only when all of them pass, and the last line names those that did not. A tool that
the test extra installs only on newer Pythons (mypy) is skipped on older ones, with a line saying so.
"""

from __future__ import annotations

import configparser
import importlib.util
import re
import shlex
import subprocess
import sys

from paths import REPO

SOURCES = ("mpidist", "tests", "benchmarks")
TIMEOUT = 300  # seconds per tool


def commands(python: str = sys.executable) -> dict[str, list[str]]:
    """Local: the tool runs by name, in order (one finding a line); mypy takes its files from pyproject.toml."""
    return {
        "ruff check": [python, "-m", "ruff", "check", "--output-format", "concise", *SOURCES],
        "ruff format": [python, "-m", "ruff", "format", "--check", "--output-format", "concise", *SOURCES],
        "mypy": [python, "-m", "mypy"],
    }


def python_needed(tool: str, requirements: str) -> tuple[int, ...] | None:
    """Local: the oldest Python that ``requirements`` (an extra's lines) installs ``tool`` for, from a
    ``; python_version >= "X.Y"`` marker; None when it installs it for every Python."""
    for line in requirements.splitlines():
        match = re.match(
            rf"{re.escape(tool)}\s*(?:[=<>!~\[][^;]*)?;\s*python_version\s*>=\s*[\"']([\d.]+)[\"']\s*$", line.strip()
        )
        if match:
            return tuple(int(part) for part in match.group(1).split("."))
    return None


def extra_requirements(name: str = "test") -> str:
    """Local: an extra of setup.cfg (by default the test tools), one requirement a line."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config["options.extras_require"][name]


def run(command: list[str]) -> bool:
    """Local: run one tool in the repository, its output passed through; True when it passed, or
    when the test extra does not install it for this Python (said so)."""
    print(f"--- {shlex.join(command[2:])}", flush=True)  # as people type it
    tool = command[2]
    if importlib.util.find_spec(tool) is None:
        oldest = python_needed(tool, extra_requirements())
        if oldest is not None and sys.version_info < oldest:
            print(
                f"{tool}: not run: the test extra installs it for Python {'.'.join(map(str, oldest))} and later "
                f"only (this is {sys.version.split()[0]})"
            )
            return True
        print(f"{tool} is not installed in {sys.prefix}: pip install -e '.[test]' (the test extra pins it)")
        return False
    try:
        return subprocess.run(command, cwd=REPO, stdin=subprocess.DEVNULL, timeout=TIMEOUT).returncode == 0
    except subprocess.TimeoutExpired:
        print(f"{tool}: no answer after {TIMEOUT} s")
        return False


def main() -> int:
    failed = [name for name, command in commands().items() if not run(command)]
    print(f"lint: failed: {', '.join(failed)}" if failed else "lint: passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
