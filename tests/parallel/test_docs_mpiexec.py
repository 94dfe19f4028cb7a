"""The docs' Python examples under ``mpiexec``, at the numbers of ranks their text names.

Whole jobs, started by these (serial) tests, each in a directory of its own under a timeout;
the markers are described in ``tests/helpers/docs_examples.py``. Also: the output of
``checkpoint inspect`` that ``docs/checkpoints.md`` shows, from the save its example writes.
"""

from __future__ import annotations

import re
import sys

import pytest

from docs_examples import TIMEOUT, blocks, rank_outputs, run_block
from mpirun import run_command
from paths import REPO

BLOCKS = [b for b in blocks() if any(ranks is not None for ranks in b.ranks)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_runs_under_mpiexec(block, tmp_path):
    outputs = {}
    for ranks in (k for k in block.ranks if k is not None):
        directory = tmp_path / f"n{ranks}"
        directory.mkdir()
        result = run_block(block, ranks, directory)
        assert result.returncode == 0, result.describe()
        printed = rank_outputs(directory)
        assert sorted(printed) == list(range(ranks)), (printed, result.describe())
        outputs[ranks] = {line for lines in printed.values() for line in lines}
    if block.same_output:
        assert len({frozenset(lines) for lines in outputs.values()}) == 1, outputs


def test_checkpoint_inspect_prints_what_the_docs_show(tmp_path):
    page = REPO / "docs" / "checkpoints.md"
    (example,) = (b for b in blocks([page]) if "md.Checkpoint(" in b.code.source)
    assert example.ranks == (3,)  # the listing below shows a save of 3 ranks
    result = run_block(example, 3, tmp_path)
    assert result.returncode == 0, result.describe()
    shown = re.search(r"## Inspecting a checkpoint\n\n```\n\$ (python .*)\n((?:.+\n)+?)```", page.read_text())
    command = shown.group(1).split()
    listing = run_command([sys.executable, *command[1:]], TIMEOUT, cwd=tmp_path)
    assert listing.returncode == 0, listing.describe()

    def same(text):  # what differs from one save to another: its number, time and mpidist's version
        text = re.sub(r"ckpt-\d{6}", "ckpt-N", text)
        return re.sub(r"saved \S+ by mpidist \S+ on", "saved TIME by mpidist VERSION on", text)

    assert same(listing.stdout) == same(shown.group(2))
