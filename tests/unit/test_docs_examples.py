"""The docs' Python examples are tests: every block is marked, and the ``python`` runs pass.

The convention (markers, hidden set-up and checks) is described in
``tests/helpers/docs_examples.py``; ``tests/parallel/test_docs_mpiexec.py`` runs the blocks
under ``mpiexec``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from docs_examples import blocks, run_block
from paths import REPO

BLOCKS = blocks()


def test_every_python_block_is_marked():
    problems = [f"{b.name}: {b.problem}" for b in BLOCKS if b.problem]
    assert not problems, (
        "mark each ```python block of the README and docs/ with the ranks its text names "
        "(see tests/helpers/docs_examples.py):\n" + "\n".join(problems)
    )


def test_markers_are_read_with_their_set_up_and_check(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: python; mpiexec -n 1,3; same output\n"
        "x = 2\n"
        "-->\n"
        "```python\n"
        "y = x + 1\n"
        "```\n"
        "<!-- then: assert y == 3 -->\n"
        "\n"
        "<!-- skip: needs a GPU -->\n"
        "```python\n"
        "import cupy\n"
        "```\n"
        "```python\n"
        "unmarked = True\n"
        "```\n"
        "<!-- run: mpiexec -n two -->\n"
        "```python\n"
        "```\n"
        "<!-- run: same output -->\n"
        "```python\n"
        "```\n"
        "```bash\n"
        "not python\n"
        "```\n"
    )
    first, skipped, unmarked, malformed, no_run = blocks([page])
    assert (first.line, first.code.line, first.code.source) == (4, 5, "y = x + 1\n")
    assert first.ranks == (None, 1, 3) and first.same_output and first.problem is None
    assert (first.setup.line, first.setup.source) == (2, "x = 2\n")
    assert (first.then.line, first.then.source) == (7, "assert y == 3\n")
    assert skipped.skip == "needs a GPU" and skipped.ranks == ()
    assert "no <!-- run" in unmarked.problem and "'mpiexec -n two'" in malformed.problem
    assert "names no run" in no_run.problem
    assert run_block(first, None, tmp_path).returncode == 0
    failing = dataclasses.replace(first, then=dataclasses.replace(first.then, source="assert y == 4\n"))
    result = run_block(failing, None, tmp_path)
    assert result.returncode == 1 and f'File "{page}", line 7' in result.stderr, result.describe()


@pytest.mark.parametrize("block", [b for b in BLOCKS if None in b.ranks], ids=lambda b: b.name)
def test_block_runs_with_python(block, tmp_path):
    result = run_block(block, None, tmp_path)
    assert result.returncode == 0, result.describe()


def test_the_main_jobs_size_is_what_the_docs_say():
    text = (REPO / "docs" / "index.md").read_text()
    claimed = int(re.search(r"train_digits\.py` \(about (\d+) lines\)", text).group(1))
    actual = len((REPO / "mpidist" / "examples" / "train_digits.py").read_text().splitlines())
    assert abs(actual - claimed) <= actual // 10, f"docs/index.md says about {claimed} lines; it has {actual}"
