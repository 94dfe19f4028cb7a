"""Saves and restores that fail or are left midway on one rank, caught, and tried again.

    mpiexec -n N python checkpoint_interrupt_job.py DIRECTORY OUT_DIR

For each scenario (a fresh checkpoint directory each), save 1 completes. Then one rank ``F``
(the last rank; rank 0 where the commit fails) fails inside save 2 or inside a restore of
save 1, in the way the scenario names, once. Every rank catches whatever its call raises
(``KeyboardInterrupt`` too) and calls again, with the same values, until a call succeeds or
three calls failed. ``leave-*`` scenarios make ``F`` leave the protocol in the middle of a
step's collective (an interrupt arriving there), so its next call meets the others while they
are still in the earlier one.

Each rank writes ``OUT_DIR/rank<R>.json``: for each scenario, every call's seconds and outcome
(``ok`` or ``Type: message``), what ``read_checkpoint`` gives right after the first failed call
(nothing lost), the hidden entries of the directory then, and the values after the last call.
``abort_on_error`` is off and the deadline is 10 s, so a rank that waits where it should not
ends at the deadline instead of hanging. tests/parallel/test_checkpoint_interrupted.py reads
the files.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

import mpidist
from mpidist._checkpoint import format as fmt, reader
from mpidist._checkpoint.checkpoint import Checkpoint, read_checkpoint
from resumable import Position

directory, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
strategy = mpidist.MPIStrategy(device="cpu", abort_on_error=False, timeout=10)
comm = strategy.communicator
rank, size = strategy.rank, strategy.num_replicas_in_sync
last = size - 1
with strategy.scope():
    weights = mpidist.Variable(np.zeros(40, np.float32), name="weights")
    counter = mpidist.Variable(np.zeros((), np.int64), name="counter", synchronization="on_read", aggregation="sum")
position = Position()
checkpoint = Checkpoint(weights=weights, counter=counter, position=position)


def set_model(k: int) -> None:
    """Values of save k: weights k, a counter totalling 10 k, position k. Local."""
    with strategy.scope():
        weights.assign(np.full(40, k, np.float32))
        counter.assign(np.array(10 * k))
    position.position = k


def once(owner, attribute: str, error: BaseException, when=None) -> None:
    """Make ``owner.attribute`` raise ``error`` on its first call for which ``when(*args)`` holds."""
    real = getattr(owner, attribute)

    def fault(*args, **kwargs):
        if when is None or when(*args, **kwargs):
            setattr(owner, attribute, real)
            raise error
        return real(*args, **kwargs)

    setattr(owner, attribute, fault)


def in_step(step: str):
    return lambda error, name: name == step


# scenario: (the operation that fails, the rank that fails, how)
SCENARIOS = {
    "oserror-write": ("save", last, lambda: once(fmt, "write_pieces", OSError(5, "injected"))),
    "interrupt-write": ("save", last, lambda: once(fmt, "write_pieces", KeyboardInterrupt("injected"))),
    "interrupt-commit": ("save", 0, lambda: once(fmt, "commit", KeyboardInterrupt("injected"))),
    "leave-write": (
        "save",
        last,
        lambda: once(comm, "outcome", KeyboardInterrupt("injected"), in_step("Checkpoint.save 3/4: write")),
    ),
    "leave-value": ("save", last, lambda: once(counter.policy, "save_value", RuntimeError("injected"))),
    "interrupt-read": ("restore", last, lambda: once(reader.Save, "read", KeyboardInterrupt("injected"))),
    "leave-read": (
        "restore",
        last,
        lambda: once(comm, "outcome", KeyboardInterrupt("injected"), in_step("Checkpoint.restore 3/4: read")),
    ),
}


def values() -> dict:
    """This rank's weights (one number: all elements alike) and position. Local."""
    w = np.asarray(weights.values[0])
    return {"weights": float(w[0]) if (w == w[0]).all() else "mixed", "position": position.position}


def run(scenario: str) -> dict:
    operation, failing, arm = SCENARIOS[scenario]
    path = directory / scenario
    set_model(1)
    checkpoint.save(path)
    if operation == "save":
        set_model(2)
        call = lambda: checkpoint.save(path)  # noqa: E731
    else:
        set_model(0)
        call = lambda: checkpoint.restore(path)  # noqa: E731
    if rank == failing:
        arm()
    report: dict = {"calls": []}
    for _ in range(3):
        started = time.monotonic()
        try:
            call()
            outcome = "ok"
        except BaseException as exc:  # KeyboardInterrupt too: the program goes on
            outcome = f"{type(exc).__name__}: {exc}"
        report["calls"].append([round(time.monotonic() - started, 2), outcome])
        if outcome == "ok":
            break
        if len(report["calls"]) == 1:
            report["after_failure"] = {
                "saved": float(read_checkpoint(path)["weights"][0]),
                "hidden": sorted(p.name for p in path.iterdir() if p.name.startswith(".")),
                **values(),
            }
    report["saves"] = [p.name for p in fmt.list_versions(path)]
    report["newest"] = float(read_checkpoint(path)["weights"][0])
    report.update(values())
    return report


reports = {scenario: run(scenario) for scenario in SCENARIOS}
(out_dir / f"rank{rank}.json").write_text(json.dumps(reports, indent=1))
strategy.free()
