"""The timeline of whole jobs: what every rank writes with ``MPIDIST_TIMELINE``, and ``python -m mpidist timeline``.

Each test launches ``tests/helpers/samples/timeline_job.py`` under a real ``mpiexec`` (at 2 and 3
ranks), then reads the files: valid JSON, one ``pid`` per rank, an event for every collective the
rank's communicator made, with its number; the merge writes one trace and the table, names the rank
made slow as the one the others waited for, and recovers clock offsets injected into the files
(the ranks here share one clock), within the interval causality allows.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpidist._tools.timeline import align, read_directory
from mpirun import MPIResult, run_mpi
from paths import SAMPLES

JOB = str(SAMPLES / "timeline_job.py")
STEPS = 12


def launch(n: int, out: Path, *args: str) -> MPIResult:
    env = {**os.environ, "MPIDIST_TIMELINE": str(out / "timeline")}
    return run_mpi(n, [sys.executable, JOB, str(out), "--steps", str(STEPS), *args], timeout=120, env=env)


def merge(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpidist", "timeline", str(directory), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def collectives(events: list[dict], tid: int = 1) -> dict[int, list[dict]]:
    """The events of each collective of track ``tid``, by collective number."""
    found: dict[int, list[dict]] = {}
    for e in events:
        if e.get("tid") == tid and e.get("cat") in ("wait", "transfer", "in flight"):
            found.setdefault(e["args"]["seq"], []).append(e)
    return found


@pytest.fixture(scope="module", params=[2, 3])
def slow_job(request, tmp_path_factory):
    """A job at 2 or 3 ranks whose last rank sleeps in every step."""
    n = request.param
    out = tmp_path_factory.mktemp(f"timeline{n}")
    result = launch(n, out, "--slow", str(n - 1), "--sleep", "0.03")
    assert result.returncode == 0, result.describe()
    return n, out, result


def test_every_rank_writes_a_valid_trace_with_an_event_for_every_collective(slow_job):
    n, out, result = slow_job
    kinds = None
    for r in range(n):
        events = json.loads((out / "timeline" / f"timeline-rank{r}.json").read_text())  # complete: valid JSON
        assert {e["pid"] for e in events} == {r}, result.describe()
        made = json.loads((out / f"job-rank{r}.json").read_text())["collectives"]
        found = collectives(events)
        assert sorted(found) == list(range(1, made + 1))  # every collective, numbered as the communicator did
        mine = {seq: [e["cat"] for e in parts] for seq, parts in found.items()}
        assert kinds is None or mine == kinds  # the same collectives on every rank
        kinds = mine
        waits = [e for e in events if e.get("cat") == "wait" and e["args"]["kind"] == "allreduce"]
        small = [e for e in waits if e["args"]["name"] == "small"]
        large = [e for e in waits if e["args"]["name"] == "large"]
        assert len(small) == len(large) == STEPS
        assert small[0]["args"]["bytes"] == 8
        assert large[0]["args"]["bytes"] == 4 << 15
        # the small update rides in the agreement; the large one's data moves after it
        assert not any(parts[1:] for seq, parts in found.items() if seq in {e["args"]["seq"] for e in small})
        assert all(found[e["args"]["seq"]][1]["cat"] == "transfer" for e in large)
        for e in large:
            wait, transfer = found[e["args"]["seq"]]
            assert abs(transfer["ts"] - (wait["ts"] + wait["dur"])) <= 1  # whole microseconds
        assert [e["args"]["step"] for e in events if e.get("cat") == "step"] == list(range(1, STEPS + 1))
        assert len([e for e in events if e.get("cat") == "input"]) == STEPS + 1  # the last one ends the epoch
        assert [e["args"]["name"] for e in events if e.get("cat") == "in flight"] == ["nonblocking"]
        assert [e["args"]["seq"] for e in events if e.get("cat") == "handle"] == [
            e["args"]["seq"] for e in events if e.get("cat") == "in flight"
        ]
        assert events[-1]["name"] == "timeline end"


def test_the_merge_writes_one_trace_and_the_table_and_names_the_slow_rank(slow_job):
    n, out, _ = slow_job
    done = merge(out / "timeline")
    assert done.returncode == 0, done.stdout + done.stderr
    merged = json.loads((out / "timeline" / "timeline.json").read_text())
    events = merged["traceEvents"]
    assert {e["pid"] for e in events} == set(range(n))
    assert min(e["ts"] for e in events if "ts" in e) == 0
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "rank",
        "host",
        "computing",
        "waiting",
        "transferring",
        "last",
        "to",
        "arrive",
        "others",
        "waited",
        "for",
        "it",
    ]
    assert [line.split()[0] for line in lines[1 : n + 1]] == [str(r) for r in range(n)]
    slow = n - 1
    assert f"the others waited most for rank {slow}:" in done.stdout, done.stdout
    # the slow rank waits least; the others wait about its sleep in every step
    waits = {r: _seconds(lines[1 + r].split()[4:6]) for r in range(n)}
    assert min(waits, key=waits.get) == slow, done.stdout
    assert all(waits[r] > 0.5 * STEPS * 0.03 for r in range(slow)), done.stdout


def test_the_merge_draws_the_wait_per_step(slow_job):
    pytest.importorskip("matplotlib")
    _, out, _ = slow_job
    done = merge(out / "timeline", "--out", str(out / "again.json"), "--picture", str(out / "waits.png"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "waits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "again.json").exists()


def test_clock_offsets_injected_into_the_files_are_recovered(slow_job, tmp_path):
    n, out, _ = slow_job
    injected = {0: 0.0, 1: 1234.5678e6, 2: -0.25e6}  # microseconds: rank r's clock reads injected[r] more
    for r in range(n):
        events = json.loads((out / "timeline" / f"timeline-rank{r}.json").read_text())
        for e in events:
            if "ts" in e:
                e["ts"] = round(e["ts"] + injected[r], 3)
        (tmp_path / f"timeline-rank{r}.json").write_text(json.dumps(events))
    offsets = align(read_directory(str(tmp_path)))
    # On this test machine ranks share cores, so a rank may notice an agreement's end a fraction of a millisecond
    # late; with a core per rank the ends agree within microseconds (tests/unit/test_timeline_merge.py models that).
    for r in range(1, n):
        found = offsets[r]
        assert found.matched > 2 * STEPS
        assert found.lower_us - 1 <= injected[r] <= found.upper_us + 1, found  # causality holds it (whole us)
        assert abs(found.offset_us - injected[r]) <= 2000, found
    done = merge(tmp_path, "--no-picture")
    assert done.returncode == 0, done.stdout + done.stderr
    printed = re.search(r"clock of rank 1: ([-+][\d.]+) s against rank 0, \+- [\d.]+ \w+ ", done.stdout)
    assert printed, done.stdout
    assert abs(float(printed.group(1)) * 1e6 - injected[1]) <= 2000
    assert f"the others waited most for rank {n - 1}:" in done.stdout, done.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_with_every_check_off_each_collective_is_one_transfer_event(n, tmp_path):
    result = launch(n, tmp_path, "--checks-off")
    assert result.returncode == 0, result.describe()
    for r in range(n):
        events = json.loads((tmp_path / "timeline" / f"timeline-rank{r}.json").read_text())
        made = json.loads((tmp_path / f"job-rank{r}.json").read_text())["collectives"]
        found = collectives(events)
        assert sorted(found) == list(range(1, made + 1))
        # the creation is agreed whatever the options (they are compared); nothing after it
        agreed = [parts[0]["args"]["kind"] for parts in found.values() if parts[0]["cat"] == "wait"]
        assert agreed == ["create"]
        assert all([e["cat"] for e in parts] == ["transfer"] for parts in found.values() if parts[0]["cat"] != "wait")
    done = merge(tmp_path / "timeline", "--no-picture")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_file_an_earlier_job_of_as_many_ranks_left_is_not_merged(slow_job, tmp_path):
    n, earlier, _ = slow_job
    result = launch(n, tmp_path)
    assert result.returncode == 0, result.describe()
    stale = f"timeline-rank{n - 1}.json"  # as if this job had not recorded on its last rank
    (tmp_path / "timeline" / stale).write_bytes((earlier / "timeline" / stale).read_bytes())
    done = merge(tmp_path / "timeline", "--no-picture")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"note: left out rank {n - 1}'s file: it comes from another job of {n} ranks" in done.stdout, done.stdout
    assert f"note: no file of rank(s) {n - 1}" in done.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_a_killed_job_leaves_files_the_merge_reads(n, tmp_path):
    result = launch(n, tmp_path, "--kill")
    assert result.returncode != 0, result.describe()
    for r in range(n):
        text = (tmp_path / "timeline" / f"timeline-rank{r}.json").read_text()
        assert not text.rstrip().endswith("]")
        made = json.loads((tmp_path / f"job-rank{r}.json").read_text())["collectives"]
        events = [json.loads(line.rstrip(",")) for line in text.splitlines()[1:]]
        assert sorted(collectives(events)) == list(range(1, made + 1))  # written before the kill
    done = merge(tmp_path / "timeline", "--no-picture")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rank {n - 1}'s file was not completed" in done.stdout
    assert json.loads((tmp_path / "timeline" / "timeline.json").read_text())["traceEvents"]


@pytest.mark.parametrize("n", [2, 3])
def test_the_main_job_with_a_slowed_rank_names_it(n, tmp_path):
    argv = [sys.executable, "-m", "mpidist.examples.train_digits", "--no-checkpoint", "--epochs", "1"]
    env = {**os.environ, "MPIDIST_TIMELINE": str(tmp_path / "timeline")}
    # 0.04 s a step: on a loaded machine (two busy processes on two cores) 0.01 s was lost in what the load
    # did to the other ranks, and the merge named rank 0 in 2 runs of 12
    result = run_mpi(n, [*argv, "--progress", "none", "--slow", f"{n - 1}:0.04"], timeout=120, env=env)
    assert result.returncode == 0, result.describe()
    done = merge(tmp_path / "timeline", "--no-picture")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the others waited most for rank {n - 1}:" in done.stdout, done.stdout


def _seconds(cell: list[str]) -> float:
    value, unit = float(cell[0]), cell[1]
    return value * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
