"""The timeline's serial parts: reading rank files (also cut short), aligning clocks, the table, the command line.

The rank files here are made up, in the format the recording writes, from a model of a job: each
collective's agreement completes on every rank a little after the last rank started it, and
each rank's clock runs off the reference by an offset (and for one rank a drift) that the tests
then expect the merge to recover within the bound it reports.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mpidist._options import Options
from mpidist._tools.cli import main
from mpidist._tools.timeline import align, format_table, read_directory, read_trace, step_waits, summarize

SIZE = 3


def rank_events(rank: int, size: int, collectives: list[tuple[float, float, float]], steps: list[float]) -> list:
    """The events of one rank's file: the header, its communicator's track, one agreement per collective
    (start, end, and the end of a transfer after it), one step event per step start."""
    events = [
        {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
        {
            "ph": "i",
            "s": "p",
            "pid": rank,
            "tid": 0,
            "ts": 0,
            "name": "timeline",
            "args": {"rank": rank, "size": size, "host": f"node{rank}"},
        },
        {"ph": "M", "pid": rank, "tid": 1, "name": "thread_name", "args": {"name": "c", "rank": rank, "size": size}},
    ]
    for seq, (start, end, transferred) in enumerate(collectives, 1):
        args = {"kind": "allreduce", "name": "g", "bytes": 8, "seq": seq}
        events.append(
            {
                "ph": "X",
                "cat": "wait",
                "pid": rank,
                "tid": 1,
                "ts": start,
                "dur": end - start,
                "name": "a",
                "args": args,
            }
        )
        if transferred > end:
            events.append(
                {
                    "ph": "X",
                    "cat": "transfer",
                    "pid": rank,
                    "tid": 1,
                    "ts": end,
                    "dur": transferred - end,
                    "name": "transfer",
                    "args": {"seq": seq},
                }
            )
    for k, start in enumerate(steps, 1):
        events.append(
            {
                "ph": "X",
                "cat": "step",
                "pid": rank,
                "tid": 0,
                "ts": start,
                "dur": 1.0,
                "name": "step",
                "args": {"step": k},
            }
        )
    return events


def model_job(directory: Path, offsets, slow, collectives: int = 400, drift: float = 0.0, gap: float = 200.0):
    """Write the files of a job of SIZE ranks in which rank ``slow`` (if any) starts each collective last; rank r's
    clock reads ``offsets[r]`` more than rank 0's (rank SIZE - 1 also drifts by ``drift`` per microsecond); a gap
    of ``gap`` microseconds and more between collectives. Returns when the last one ended."""
    rng = random.Random(0)
    per_rank = {r: [] for r in range(SIZE)}
    steps = {r: [] for r in range(SIZE)}
    t = 1000.0
    for k in range(collectives):
        arrive = {r: t + rng.uniform(0, 30) + (400.0 if r == slow else 0.0) for r in range(SIZE)}
        done = max(arrive.values()) + 3.0
        for r in range(SIZE):
            seen = done + rng.uniform(0, 20)  # each rank notices the completion a little later
            clock = offsets[r] + (drift * t if r == SIZE - 1 else 0.0)
            per_rank[r].append((arrive[r] + clock, seen + clock, seen + clock + (50.0 if k % 2 else 0.0)))
            if k % 4 == 0:
                steps[r].append(arrive[r] - 10 + clock)
        t = done + gap + rng.uniform(0, 100)
    for r in range(SIZE):
        (directory / f"timeline-rank{r}.json").write_text(json.dumps(rank_events(r, SIZE, per_rank[r], steps[r])))
    return t


def test_clock_offsets_are_recovered_within_the_bound_and_the_bound_holds_them(tmp_path):
    offsets = {0: 0.0, 1: 3_000_000.0, 2: -12_345.5}
    model_job(tmp_path, offsets, slow=1)
    found = align(read_directory(str(tmp_path)))
    for r in (1, 2):
        assert found[r].lower_us <= offsets[r] <= found[r].upper_us, found[r]  # causality holds the truth
        assert found[r].consistent, found[r]
        assert abs(found[r].offset_us - offsets[r]) <= 5, found[r]  # microseconds
        assert 2 <= found[r].spread_us <= 8, found[r]  # the model's ends differ by uniform(-20, 20) us
        assert found[r].drift == 0.0
    assert found[1].upper_us - found[1].lower_us > 300  # rank 1 always arrives last: one side stays wide


def test_causality_pins_the_offsets_where_every_rank_is_sometimes_the_last_to_arrive(tmp_path):
    offsets = {0: 0.0, 1: -2_000.25, 2: 41_000.0}
    model_job(tmp_path, offsets, slow=None)
    found = align(read_directory(str(tmp_path)))
    for r in (1, 2):
        assert found[r].lower_us <= offsets[r] <= found[r].upper_us, found[r]
        assert found[r].upper_us - found[r].lower_us < 50, found[r]


def test_a_drifting_clock_is_fitted_with_its_drift(tmp_path):
    offsets = {0: 0.0, 1: 7.0, 2: 5_000_000.0}
    end = model_job(tmp_path, offsets, slow=0, collectives=4000, drift=20e-6, gap=5000.0)  # 20 us per second
    assert end > 2e7  # 20 s: the clock drifts by 400 us, far more than the ends differ
    found = align(read_directory(str(tmp_path)))
    assert found[2].drift == pytest.approx(20e-6, rel=0.05)
    for t in (1000.0, end / 2, end):
        assert abs(found[2](offsets[2] + t) - (offsets[2] + 20e-6 * t)) < 40, (t, found[2])
    assert not found[1].drift


def test_the_table_names_the_rank_that_starts_last(tmp_path):
    model_job(tmp_path, {0: 0.0, 1: 250.0, 2: -80.0}, slow=2)
    traces = read_directory(str(tmp_path))
    offsets = align(traces)
    summaries = summarize(traces, offsets)
    assert max(summaries, key=lambda s: s.caused).rank == 2
    assert min(summaries, key=lambda s: s.wait).rank == 2  # the slow rank waits least
    assert [s.transfer for s in summaries] == pytest.approx([200 * 50e-6] * SIZE)
    table = format_table(summaries, offsets)
    assert "the others waited most for rank 2:" in table
    assert "clock of rank 1: +0.0002" in table
    assert table.splitlines()[0].split()[:5] == ["rank", "host", "computing", "waiting", "transferring"]
    assert [line.split()[1] for line in table.splitlines()[1:4]] == ["node0", "node1", "node2"]


def test_wait_per_step_counts_each_agreement_in_the_step_it_began_in(tmp_path):
    model_job(tmp_path, {0: 0.0, 1: 0.0, 2: 0.0}, slow=1, collectives=40)
    waits = {r: step_waits(t) for r, t in read_directory(str(tmp_path)).items()}
    assert [len(w) for w in waits.values()] == [10, 10, 10]  # a step every 4 collectives
    assert all(waits[0][i] > 4 * 350e-6 > waits[1][i] for i in range(10))  # 4 agreements of a 400 us wait each


def test_a_file_cut_short_is_read_up_to_its_last_whole_line(tmp_path):
    events = rank_events(0, 1, [(10.0, 12.0, 12.0), (20.0, 25.0, 30.0)], [5.0])
    text = "[\n" + "".join(json.dumps(e) + ",\n" for e in events)
    path = tmp_path / "timeline-rank0.json"
    path.write_text(text[: len(text) - 25])  # a killed writer: the last line cut in the middle
    trace = read_trace(str(path))
    assert not trace.complete and trace.skipped == 1
    assert len(trace.events) == len(events) - 1
    path.write_text(text + '{"ph":"i","name":"timeline end"}\n]\n')
    assert read_trace(str(path)).complete


def test_a_file_that_is_not_a_timeline_is_refused(tmp_path):
    path = tmp_path / "timeline-rank0.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match="not an mpidist timeline file"):
        read_trace(str(path))


@pytest.mark.parametrize(
    "content",
    [b"", b'[\n{"ph": "M", "pid": 1, "na', b"\x88\xff\x00 not text", b"[1, 2, 3]\n", b'{"traceEvents": []}'],
    ids=["empty", "cut-before-header", "binary", "not-events", "an-object"],
)
def test_a_file_that_cannot_be_read_is_left_out_with_a_note_and_the_others_merged(tmp_path, capsys, content):
    model_job(tmp_path, {0: 0.0, 1: 0.0, 2: 0.0}, slow=2, collectives=20)
    (tmp_path / "timeline-rank1.json").write_bytes(content)
    assert main(["timeline", str(tmp_path), "--no-picture"]) == 0
    printed = capsys.readouterr().out
    assert f"note: left out {tmp_path / 'timeline-rank1.json'}: not a" in printed, printed
    assert "note: no file of rank(s) 1: merging the 2 there are" in printed
    assert "the others waited most for rank 2" in printed
    assert {e["pid"] for e in json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]} == {0, 2}


def test_a_directory_whose_only_file_cannot_be_read_fails_saying_so(tmp_path, capsys):
    (tmp_path / "timeline-rank0.json").mkdir()
    assert main(["timeline", str(tmp_path), "--no-picture"]) == 1
    printed = capsys.readouterr().out
    assert f"note: left out {tmp_path / 'timeline-rank0.json'}: Is a directory" in printed
    assert "no timeline file that could be read in" in printed


def test_files_of_an_earlier_job_of_another_size_are_left_out(tmp_path, capsys):
    model_job(tmp_path, {0: 0.0, 1: 0.0, 2: 0.0}, slow=1, collectives=20)  # the earlier job, of 3 ranks
    later = tmp_path / "later"
    later.mkdir()
    model_job(later, {0: 0.0, 1: 0.0, 2: 0.0}, slow=0, collectives=30)
    for r in (0, 1):  # a later job of 2 ranks overwrote ranks 0 and 1; rank 2's file is the earlier job's
        events = json.loads((later / f"timeline-rank{r}.json").read_text())
        events = [e for e in events if e.get("pid") != 2]
        for e in events:
            if e.get("name") == "timeline" or e.get("name") == "thread_name":
                e["args"]["size"] = 2
            if e.get("name") == "timeline":
                e["args"]["wall_time"] = 2000.0
        (tmp_path / f"timeline-rank{r}.json").write_text(json.dumps(events))
    notes: list = []
    traces = read_directory(str(tmp_path), notes)
    assert sorted(traces) == [0, 1]
    assert notes == ["left out rank 2's file: it comes from another job, of 3 ranks (the last job to start had 2)"]
    assert main(["timeline", str(tmp_path), "--no-picture"]) == 0
    printed = capsys.readouterr().out
    assert "the others waited most for rank 0" in printed and "clock of rank 2" not in printed


def set_header(path: Path, **fields) -> None:
    """Rewrite the ``timeline`` event of the rank file ``path`` with ``fields`` in its ``args`` (``None``: without)."""
    events = json.loads(path.read_text())
    for e in events:
        if e.get("name") == "timeline":
            e["args"].update(fields)
            e["args"] = {key: value for key, value in e["args"].items() if value is not None}
    path.write_text(json.dumps(events))


def test_files_of_an_earlier_job_of_the_same_size_are_left_out(tmp_path, capsys):
    model_job(tmp_path, {0: 0.0, 1: 0.0, 2: 0.0}, slow=1, collectives=20)  # the earlier job, of 3 ranks
    set_header(tmp_path / "timeline-rank1.json", job="vm:41:1000", wall_time=1000.0)
    later = tmp_path / "later"
    later.mkdir()
    model_job(later, {0: 0.0, 1: 0.0, 2: 0.0}, slow=0, collectives=30)
    for r in (0, 2):  # a later job of 3 ranks recorded on ranks 0 and 2 only: rank 1's file is the earlier job's
        set_header(later / f"timeline-rank{r}.json", job="vm:57:2000", wall_time=2000.0 + r)
        (tmp_path / f"timeline-rank{r}.json").write_bytes((later / f"timeline-rank{r}.json").read_bytes())
    notes: list = []
    assert sorted(read_directory(str(tmp_path), notes)) == [0, 2]
    assert notes == [
        "left out rank 1's file: it comes from another job of 3 ranks (job vm:41:1000; "
        "the last job to start is vm:57:2000)"
    ]
    assert main(["timeline", str(tmp_path), "--no-picture"]) == 0
    printed = capsys.readouterr().out
    assert "note: left out rank 1's file" in printed and "note: no file of rank(s) 1" in printed
    assert "the others waited most for rank 0" in printed and "clock of rank 1" not in printed
    set_header(tmp_path / "timeline-rank1.json", job=None)  # a file of an earlier version, without the field
    notes = []
    assert sorted(read_directory(str(tmp_path), notes)) == [0, 1, 2] and notes == []  # merged, as before


def test_a_file_that_holds_another_ranks_events_is_left_out(tmp_path):
    model_job(tmp_path, {0: 0.0, 1: 0.0, 2: 0.0}, slow=1, collectives=10)
    (tmp_path / "timeline-rank2.json").write_bytes((tmp_path / "timeline-rank0.json").read_bytes())
    notes: list = []
    assert sorted(read_directory(str(tmp_path), notes)) == [0, 1]
    assert notes == [f"left out {tmp_path / 'timeline-rank2.json'}: it holds the events of rank 0"]


def test_the_command_line_lists_and_explains_the_command():
    listed = subprocess.run([sys.executable, "-m", "mpidist", "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "timeline" in listed.stdout
    helped = subprocess.run(
        [sys.executable, "-m", "mpidist", "timeline", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0
    for words in ("MPIDIST_TIMELINE", "align the ranks' clocks", "which rank the others waited for", "--picture"):
        assert words in " ".join(helped.stdout.split()), helped.stdout


def test_a_directory_without_files_fails_with_a_hint(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mpidist", "timeline", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "run the job with MPIDIST_TIMELINE set" in done.stdout


def test_without_matplotlib_the_command_says_how_to_install_it_and_writes_the_rest(tmp_path, monkeypatch, capsys):
    model_job(tmp_path, {0: 0.0, 1: 0.0, 2: 0.0}, slow=0, collectives=20)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["timeline", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "pip install 'mpidist[timeline]'" in printed
    assert "the others waited most for rank 0" in printed
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert not (tmp_path / "timeline.png").exists()


def test_the_option_comes_from_the_keyword_or_the_environment():
    assert Options.resolve({}).timeline is None
    assert Options.resolve({"MPIDIST_TIMELINE": "/x/y"}).timeline == "/x/y"
    assert Options.resolve({"MPIDIST_TIMELINE": " "}).timeline is None
    assert Options.resolve({"MPIDIST_TIMELINE": "/x"}, timeline=Path("/z")).timeline == "/z"
    with pytest.raises(TypeError, match="option timeline must be a directory"):
        Options.resolve({}, timeline=3)


@pytest.mark.parametrize("option", ["--out", "--picture"])
def test_a_trace_or_picture_that_cannot_be_written_is_one_line_and_status_1(tmp_path, capsys, option):
    # Before: a FileNotFoundError traceback.
    if option == "--picture":
        pytest.importorskip("matplotlib")
    model_job(tmp_path, {0: 0.0, 1: 250.0, 2: -80.0}, slow=2, collectives=20)
    blocker = tmp_path / "file"
    blocker.write_text("")
    extra = [] if option == "--picture" else ["--no-picture"]
    assert main(["timeline", str(tmp_path), option, str(blocker / "x"), *extra]) == 1
    what = "draw the picture to" if option == "--picture" else "write the merged trace to"
    assert capsys.readouterr().err == f"mpidist timeline: error: cannot {what} {blocker / 'x'}: Not a directory\n"
