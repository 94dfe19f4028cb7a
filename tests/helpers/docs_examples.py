"""The Python examples of the README and ``docs/*.md``, found and run as a user would run them.

Every ```` ```python ```` block carries a marker, an HTML comment on the line right above its
opening fence (invisible on GitHub and in the Sphinx pages):

    <!-- run: python -->                     python example.py
    <!-- run: mpiexec -n 3 -->               mpiexec -n 3 python example.py
    <!-- run: python; mpiexec -n 4 -->       both
    <!-- run: mpiexec -n 1,2,3; same output -->
                                             at each count, and every run prints the same lines
    <!-- skip: needs a GPU -->               never run (say why)

The numbers of ranks are those the page's text names. A fragment that uses names it does not
define gets them from hidden set-up code: the lines after the marker's first line, up to
``-->``, run before the block. A comment right below the closing fence, ``<!-- then:`` and
lines of code up to ``-->``, runs after it (a check of what the page promises):

    <!-- run: mpiexec -n 2
    import numpy as np
    x_train = np.zeros((512, 8))
    -->
    ```python
    ...
    ```
    <!-- then:
    assert ...
    -->

Each run starts a new process (``mpiexec`` ones through :func:`mpirun.run_mpi`) in an empty
directory of its own, under a timeout. Its script runs the set-up, the block and the check
compiled under the page's name and line numbers, so that a traceback points into the page.
``tests/unit/test_docs_examples.py`` checks the markers and runs the ``python`` runs;
``tests/parallel/test_docs_mpiexec.py`` runs the ``mpiexec`` ones, with every MPI.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Optional

from mpirun import MPIResult, mpi_env, run_command, run_mpi
from paths import REPO

__all__ = ["TIMEOUT", "Block", "blocks", "pages", "run_block", "write_script"]

TIMEOUT = 90  # seconds for one run of one block (each takes a few)

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")
_SPEC = re.compile(r"python|mpiexec -n ([1-9]\d*(?:,[1-9]\d*)*)")


@dataclasses.dataclass(frozen=True)
class Part:
    """Code of a page, with the line of the page its first line is on."""

    line: int
    source: str


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```` ```python ```` block of a page and its marker."""

    page: Path
    line: int  # of the opening fence
    code: Part
    ranks: tuple[Optional[int], ...] = ()  # one run per entry: None is a plain `python`, k is `mpiexec -n k`
    same_output: bool = False
    skip: Optional[str] = None
    setup: Optional[Part] = None
    then: Optional[Part] = None
    problem: Optional[str] = None  # a missing or malformed marker

    @property
    def name(self) -> str:
        """``docs/input.md:210``: the page and the line of the opening fence."""
        return f"{self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of ``docs/``."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(page_list: Optional[list[Path]] = None) -> list[Block]:
    """Every ```` ```python ```` block of ``page_list`` (default :func:`pages`), with its marker."""
    found = []
    for page in page_list or pages():
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
            if fence.group(2) == "python":
                found.append(_block(page, lines, i, end))
            i = end + 1
    return found


def _comment_above(lines: list[str], fence: int) -> Optional[tuple[int, list[str]]]:
    """``(index of its first line, its lines without <!-- and -->)`` of the comment ending right above ``fence``."""
    if fence == 0 or not lines[fence - 1].rstrip().endswith("-->"):
        return None
    start = next((j for j in range(fence - 1, -1, -1) if lines[j].lstrip().startswith("<!--")), None)
    if start is None:
        return None
    body = lines[start:fence]
    body[0] = body[0].lstrip()[4:]
    body[-1] = body[-1].rstrip()[:-3]
    return start, body


def _block(page: Path, lines: list[str], fence: int, end: int) -> Block:
    code = Part(fence + 2, "\n".join(lines[fence + 1 : end]) + "\n")
    block = Block(page, fence + 1, code)
    above = _comment_above(lines, fence)
    marker = above[1][0].strip() if above else ""
    kind, _, spec = marker.partition(":")
    if kind not in ("run", "skip") or not spec.strip():
        return dataclasses.replace(block, problem="no <!-- run: ... --> or <!-- skip: reason --> marker above it")
    if kind == "skip":
        return dataclasses.replace(block, skip=spec.strip())
    ranks: list[Optional[int]] = []
    same_output = False
    for item in (s.strip() for s in spec.split(";")):
        match = _SPEC.fullmatch(item)
        if item == "same output":
            same_output = True
        elif match is None:
            return dataclasses.replace(
                block, problem=f"{item!r} in its marker: expected 'python', 'mpiexec -n K[,K...]' or 'same output'"
            )
        else:
            ranks.extend([None] if match.group(1) is None else [int(k) for k in match.group(1).split(",")])
    if not ranks:
        return dataclasses.replace(block, problem="its marker names no run: 'python' or 'mpiexec -n K[,K...]'")
    assert above is not None
    setup = above[1][1:]
    then = None
    if end + 1 < len(lines) and lines[end + 1].startswith("<!-- then:"):
        stop = next((j for j in range(end + 1, len(lines)) if lines[j].rstrip().endswith("-->")), len(lines) - 1)
        body = lines[end + 1 : stop + 1]
        body[-1] = body[-1].rstrip()[:-3]
        body[0] = body[0][len("<!-- then:") :].strip()
        then = Part(end + 2, "\n".join(body).rstrip() + "\n")
    return dataclasses.replace(
        block,
        ranks=tuple(ranks),
        same_output=same_output,
        setup=Part(above[0] + 2, "\n".join(setup).rstrip() + "\n") if any(s.strip() for s in setup) else None,
        then=then,
    )


def write_script(block: Block, directory: Path) -> Path:
    """``directory/example.py``: the set-up, the block and the check, compiled as lines of the page."""
    parts = [p for p in (block.setup, block.code, block.then) if p is not None]
    script = directory / "example.py"
    script.write_text(
        f'"""{block.name}, as tests/helpers/docs_examples.py runs it."""\n'
        "import os, sys\n"
        "# under a launcher, each rank's output goes to a file of its own (launchers may splice lines of ranks)\n"
        'rank = next((os.environ[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK") if k in os.environ), None)\n'
        "if rank is not None:\n"
        '    sys.stdout = open(f"stdout-rank{rank}.txt", "w", buffering=1)\n'
        'namespace = {"__name__": "__main__"}\n'
        f"for line, source in {[(p.line, p.source) for p in parts]!r}:\n"
        f'    exec(compile("\\n" * (line - 1) + source, {str(block.page)!r}, "exec"), namespace)\n'
    )
    return script


def rank_outputs(directory: Path) -> dict[int, list[str]]:
    """The lines each rank of a :func:`run_block` under ``mpiexec`` printed, by rank."""
    return {
        int(path.stem.removeprefix("stdout-rank")): path.read_text().splitlines()
        for path in directory.glob("stdout-rank*.txt")
    }


def run_block(block: Block, ranks: Optional[int], directory: Path) -> MPIResult:
    """Run ``block`` in ``directory`` (empty, the working directory): ``python example.py`` for ``ranks``
    ``None``, else ``mpiexec -n ranks python example.py``, whose ranks write their output to
    ``directory/stdout-rankR.txt`` (:func:`rank_outputs`)."""
    script = write_script(block, directory)
    if ranks is None:
        return run_command([sys.executable, script.name], TIMEOUT, env=mpi_env(), cwd=directory)
    return run_mpi(ranks, [sys.executable, script.name], TIMEOUT, cwd=directory)
