"""The test tree itself: no folder may be named like a marker, or its tests silently stop running.

pytest counts the names of a test's folders among its keywords, and pytest-mpi skips, in a
run without ``--with-mpi``, every test whose keywords hold ``mpi``: a folder ``tests/mpi``
turned each of its serial tests (the whole-job safety, fault and launcher tests among them)
into a skip. Checked here for every marker of setup.cfg.
"""

from __future__ import annotations

import configparser

from paths import REPO


def markers() -> set[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["tool:pytest"]["markers"].strip().splitlines()
    return {line.split(":")[0].strip() for line in lines} | {"mpi"}  # mpi: pytest-mpi's own marker


def test_no_test_folder_is_named_like_a_marker():
    folders = [p for p in (REPO / "tests").rglob("*") if p.is_dir() and "__pycache__" not in p.parts]
    clashing = [str(p.relative_to(REPO)) for p in folders if p.name in markers()]
    assert not clashing, f"test folders named like pytest markers (their tests would be skipped): {clashing}"
