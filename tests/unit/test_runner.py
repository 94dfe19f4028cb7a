"""The test runner's pieces, serially and without running anything: ``tests/run.py``'s options,
labels and summary, the install commands, the lint phase's tool runs, and the check that the
namespace nodes of the system phases see the checkout (``tests/helpers/node_paths.py``)."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath

import pytest

import install
import lint
import node_paths
from node_paths import WORK_ROOT, check_nodes_see, job_paths, node_private_paths, unseen_by_nodes
from paths import REPO, TESTS

P = PurePosixPath


@pytest.fixture(scope="module")
def run():
    """``tests/run.py`` as a module (it is a script, not on the path)."""
    spec = importlib.util.spec_from_file_location("mpidist_test_runner", TESTS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- options and labels --------------------------------------------------------------------------
def test_defaults_are_both_mpis_ranks_1_2_3_lint_and_no_system(run, monkeypatch):
    monkeypatch.delenv("MPIDIST_TEST_MPIS", raising=False)
    monkeypatch.delenv("CI", raising=False)
    args = run.parse_args([])
    assert (args.mpis, args.ranks, args.system, args.no_lint, args.no_install, args.k) == (
        ["openmpi", "mpich"],
        "1,2,3",
        False,
        False,
        False,
        None,
    )
    assert run.excluded_labels(args, first=True) == ["system"]
    assert run.excluded_labels(args, first=False) == ["system", "lint", "serial"]


@pytest.mark.parametrize(
    "ci, argv, system",
    [
        ("true", [], True),
        ("1", [], True),
        ("true", ["--no-system"], False),
        ("", ["--system"], True),
        ("false", [], False),
    ],
)
def test_ci_turns_the_system_phases_on_unless_told_otherwise(run, monkeypatch, ci, argv, system):
    monkeypatch.setenv("CI", ci)
    args = run.parse_args(argv)
    assert args.system is system
    assert ("system" in run.excluded_labels(args, first=True)) is not system


@pytest.mark.parametrize("argv", [["--no-lint"], ["-k", "layout"]])
def test_no_lint_and_k_leave_lint_out(run, argv):
    assert "lint" in run.excluded_labels(run.parse_args(["--no-system", *argv]), first=True)


def test_mpis_from_the_environment_in_order_without_repeats(run, monkeypatch):
    monkeypatch.setenv("MPIDIST_TEST_MPIS", "mpich,openmpi mpich")
    assert run.parse_args([]).mpis == ["mpich", "openmpi"]
    assert run.parse_args(["--mpi", "openmpi"]).mpis == ["openmpi"]


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--ranks", "0,2"], {}),
        (["--ranks", "2,,3"], {}),
        (["-k", "a;b"], {}),
        ([], {"MPIDIST_TEST_MPIS": "lam"}),
        (["--mpi", "lam"], {}),
    ],
)
def test_bad_options_are_refused(run, monkeypatch, capsys, argv, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        run.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_configure_command_passes_ranks_k_and_the_mpis_environment(run, tmp_path):
    args = run.parse_args(["--no-system", "--ranks", "2, 3", "-k", "layout or docs"])
    venv = tmp_path / ".venv-mpich"
    command = [str(word) for word in run.configure_command("mpich", venv, tmp_path / "build", args)]
    assert command[:5] == [str(venv / "bin" / "cmake"), "-S", str(REPO), "-B", str(tmp_path / "build")]
    assert command[5:] == [
        f"-DPython3_EXECUTABLE={venv / 'bin' / 'python'}",
        f"-DMPIDIST_MPI_ENV={REPO / 'jobs' / 'env.mpich'}",
        "-DMPIDIST_TEST_RANKS=2;3",
        "-DMPIDIST_PYTEST_ARGS=-k;layout or docs",
    ]


# -- counting ------------------------------------------------------------------------------------
def _junit(path: Path, cases: list[tuple[str, str]]) -> None:
    body = "".join(f'<testcase classname="t" name="{name}">{child}</testcase>' for name, child in cases)
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")


def test_a_test_failed_when_it_failed_on_any_rank(run, tmp_path):
    (tmp_path / "junit").mkdir()
    _junit(tmp_path / "junit" / "mpi-np2.rank0.xml", [("a", ""), ("b", ""), ("c", "<skipped/>")])
    _junit(tmp_path / "junit" / "mpi-np2.rank1.xml", [("a", ""), ("b", "<failure/>"), ("c", "<skipped/>")])
    assert run.pytest_counts(tmp_path, "mpi-np2") == {"passed": 1, "failed": 1, "skipped": 1}
    assert run.pytest_counts(tmp_path, "mpi-np1") is None  # no report at all


def test_ctest_outcomes_count_where_pytest_wrote_nothing(run, tmp_path):
    (tmp_path / "junit").mkdir()
    _junit(tmp_path / "junit" / "serial.xml", [("a", ""), ("b", "<error/>")])
    _junit(tmp_path / "junit" / "mpi-np1.rank0.xml", [])  # pytest exit 5: nothing selected
    report = ET.fromstring("""<testsuite>
      <testcase name="lint" time="3.5" status="fail"><failure message="Failed"/></testcase>
      <testcase name="serial" time="20" status="fail"><failure message="Failed"/></testcase>
      <testcase name="mpi-np1" time="2" status="notrun"><skipped message="SKIP_RETURN_CODE=5"/></testcase>
      <testcase name="mpi-np2" time="120" status="fail"><failure message="Timeout"/></testcase>
      <testcase name="mpi-np3" time="9" status="run"/>
    </testsuite>""")
    rows = {name: (counts, note) for name, _, counts, note in run.ctest_rows(tmp_path, report)}
    assert rows == {
        "lint": ({"failed": 1}, " (ctest: Failed)"),  # no pytest report: the tool's outcome is one test
        "serial": ({"passed": 1, "failed": 1}, ""),  # pytest says what failed
        "mpi-np1": ({}, ""),  # skipped by CTest, nothing selected
        "mpi-np2": ({"failed": 1}, " (ctest: Timeout)"),  # died before writing its report
        "mpi-np3": ({"passed": 1}, ""),
    }


def test_summary_lines_and_total(run):
    Counter = __import__("collections").Counter
    rows = [
        ("openmpi", "lint", 3.2, Counter(failed=1), " (ctest: Failed)"),
        ("openmpi", "serial", 61.0, Counter(passed=700, skipped=3), ""),
        ("mpich", "mpi-np2", 80.4, Counter(passed=800), ""),
    ]
    lines, total = run.summary(rows)
    assert lines == [
        "openmpi  lint           0 passed, 1 failed, 0 skipped      3 s (ctest: Failed)",
        "openmpi  serial       700 passed, 0 failed, 3 skipped     61 s",
        "mpich    mpi-np2      800 passed, 0 failed, 0 skipped     80 s",
    ]
    assert total == {"passed": 1500, "failed": 1, "skipped": 3}


# -- installing ----------------------------------------------------------------------------------
def test_install_commands(tmp_path):
    venv = tmp_path / ".venv-openmpi"
    assert install.venv_command(venv) == [sys.executable, "-m", "venv", venv]
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-input"]
    assert install.pip_commands("openmpi", venv) == [
        [*pip, "pip>=21.3"],
        [*pip, "--editable", ".[test,docs,examples,mpi]"],
    ]
    assert install.requirement("mpich") == ".[test,docs,examples,mpich]"


def test_every_mpi_extra_exists_in_setup_cfg():
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    extras = set(config["options.extras_require"])
    assert {"test", "docs", "examples", *install.EXTRAS.values()} <= extras


# -- lint ----------------------------------------------------------------------------------------
def test_lint_runs_ruff_check_ruff_format_and_mypy():
    runs = lint.commands("python")
    assert list(runs) == ["ruff check", "ruff format", "mypy"]
    assert runs["ruff check"] == ["python", "-m", "ruff", "check", "--output-format", "concise", *lint.SOURCES]
    assert runs["ruff format"] == [
        "python",
        "-m",
        "ruff",
        "format",
        "--check",
        "--output-format",
        "concise",
        *lint.SOURCES,
    ]
    assert runs["mypy"] == ["python", "-m", "mypy"]  # its files come from pyproject.toml
    assert lint.SOURCES == ("mpidist", "tests", "benchmarks")


def test_lint_reports_a_missing_tool_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(lint.importlib.util, "find_spec", lambda name: None)
    assert lint.main() == 1
    out = capsys.readouterr().out
    assert "ruff is not installed" in out and "mypy is not installed" in out
    assert out.splitlines()[-1] == "lint: failed: ruff check, ruff format, mypy"


@pytest.mark.parametrize(
    "line, tool, oldest",
    [
        ('mypy==2.4.1; python_version >= "3.10"', "mypy", (3, 10)),
        ("mypy>=1 ; python_version>='3.9'", "mypy", (3, 9)),
        ("mypy==2.4.1", "mypy", None),
        ('ruff==0.17.6; python_version >= "3.10"', "mypy", None),
        ('mypy-extensions; python_version >= "3.12"', "mypy", None),
    ],
)
def test_the_oldest_python_a_tool_is_installed_for(line, tool, oldest):
    assert lint.python_needed(tool, f"pytest>=7\n{line}\n") == oldest


def test_a_tool_the_extra_leaves_out_for_this_python_is_skipped_with_a_line(monkeypatch, capsys):
    monkeypatch.setattr(lint.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(lint, "extra_requirements", lambda: 'ruff==1\nmypy==2; python_version >= "99.0"')
    assert lint.run(lint.commands()["mypy"]) is True
    assert "mypy: not run: the test extra installs it for Python 99.0 and later only" in capsys.readouterr().out
    assert lint.run(lint.commands()["ruff check"]) is False


def test_every_tool_of_the_lint_phase_is_in_the_test_extra():
    requirements = lint.extra_requirements()
    for tool in {command[2] for command in lint.commands().values()}:
        assert any(line.startswith(f"{tool}==") for line in requirements.splitlines()), f"{tool} is not pinned"


# -- what the namespace nodes see ----------------------------------------------------------------
def test_node_private_paths_come_from_nodes_up_sh():
    private = node_private_paths(node_paths.NODES_UP.read_text())
    assert P("/tmp") in private
    assert all(path.is_absolute() for path in private)


@pytest.mark.parametrize(
    "text", ["", 'NODE_PRIVATE="/tmp"\nNODE_PRIVATE="/run"\n', 'NODE_PRIVATE="tmp"\n', 'NODE_PRIVATE=""\n']
)
def test_a_missing_or_odd_declaration_is_an_error(text):
    with pytest.raises(ValueError, match="NODE_PRIVATE"):
        node_private_paths(text)


def test_a_checkout_under_tmp_is_named_with_what_to_do():
    private = [P("/tmp"), P("/etc/hosts")]
    paths = {"checkout": P("/tmp/x"), "virtual environment .venv-openmpi": P("/tmp/x/.venv-openmpi")}
    assert unseen_by_nodes(paths, private) == (
        "the checkout /tmp/x lies under /tmp, which each namespace node has "
        "its own copy of: clone it elsewhere, e.g. under /var/tmp or your home"
    )


def test_the_python_a_venv_was_made_from_counts_too():
    line = unseen_by_nodes(
        {"checkout": P("/home/me/mpidist"), "Python of .venv-mpich": P("/tmp/py/bin/python3.12")}, [P("/tmp")]
    )
    assert line is not None and line.startswith("the Python of .venv-mpich /tmp/py/bin/python3.12 lies under /tmp")
    assert "with a Python installed elsewhere" in line


@pytest.mark.parametrize("path", ["/var/tmp/x", "/tmpfoo/x", "/home/me/tmp", "/", "/etc"])
def test_paths_beside_the_private_ones_are_seen(path):
    assert unseen_by_nodes({"checkout": P(path)}, [P("/tmp"), P("/etc/hosts")]) is None


def test_the_private_path_itself_is_not_seen():
    assert unseen_by_nodes({"checkout": P("/tmp")}, [P("/tmp")]) is not None


def test_links_are_resolved(tmp_path):
    target = tmp_path / "venv"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    paths = job_paths([link])
    assert paths[f"virtual environment {link.name}"] == P(target.resolve())
    assert next(iter(paths)) == "checkout" and paths["working files"] == P(WORK_ROOT.resolve())


def test_this_checkout_and_the_working_files():
    private = node_private_paths(node_paths.NODES_UP.read_text())
    assert unseen_by_nodes({"working files": P(WORK_ROOT)}, private) is None
    expected = unseen_by_nodes(job_paths([Path(sys.prefix)]), private)
    assert check_nodes_see() == expected


def test_the_runner_stops_at_once_with_one_line(run, monkeypatch, capsys):
    monkeypatch.setattr(node_paths, "REPO", Path("/tmp/mpidist-clone"))

    def never(*args, **kwargs):
        raise AssertionError("the runner went on past the check (it would run the whole suite)")

    monkeypatch.setattr(run, "configure", never)
    monkeypatch.setattr(run, "run_ctest", never)
    assert run.main(["--system", "--mpi", "openmpi", "--no-install"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "system phases: the checkout /tmp/mpidist-clone lies under /tmp, which each namespace "
        "node has its own copy of: clone it elsewhere, e.g. under /var/tmp or your home "
        "(or leave them out: --no-system)"
    ]
