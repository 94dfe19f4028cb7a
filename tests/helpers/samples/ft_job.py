"""A small mpidist program with fault tolerance on, one of whose ranks dies on purpose.

    MPIDIST_FAULT_TOLERANCE=1 MPIDIST_TEST_KILL=RANK:agreement:N bash jobs/mpirun.sh -n 4 python ft_job.py SCENARIO

tests/parallel/test_fault_tolerance.py launches it; ``kill_at`` (tests/helpers) kills the rank at
the counted moment. Scenarios: ``allreduce`` (small reductions in a loop), ``pipelined`` (an
8 MiB reduction in 64 pieces; with ``FT_NODE_SIZE=k`` two-level, over "nodes" of ``k`` ranks),
``mirrored`` (steps of two mirrored variables' updates, with a snapshot at the start of each),
``compressed`` (a 4 MiB float32 mirrored update sent in bfloat16), ``split`` (process sets of two ranks),
``stuck`` (the survivors' shrink never returns). ``FT_DIE_IN_RECOVERY=R``: rank ``R`` dies (SIGKILL) as it
would call ``strategy.recover()``, so that the other survivors meet a second death inside their recovery;
``FT_DIE_AFTER_RECOVERY=R``: rank ``R`` dies at the start of its first step after it recovered.
``FT_COLLECTIVES_BEFORE_RECOVERY=1``: every survivor first tries collectives of the strategy without
``recover()`` (a reduction, a mirrored update, a metric's read) and records how each was refused.
Every survivor carries on after ``strategy.recover()`` and writes its outcome as JSON to
``$FT_OUT/rank<R>.json`` (``R``: its rank before the failure).
"""

import json
import os
import signal
import sys
import time
import warnings
import zlib

import numpy as np

import kill_at

kill_at.install()

import mpidist as md  # noqa: E402  (after the hook, which wraps mpidist's methods)

scenario = sys.argv[1]
# FT_NODE_SIZE=k: the two-level reduction over "nodes" of k ranks, whose communicators a failure rebuilds too
node_size = int(os.environ.get("FT_NODE_SIZE", "0"))
levels = {"hierarchical": True, "node_size": node_size} if node_size else {}
tolerant = scenario != "off"  # off: launched to survive, but the strategy's fault tolerance is off
if scenario == "compressed":  # float32 updates whose wire is bfloat16
    levels["compression"] = "bf16"
if scenario == "stuck":  # MPI's shrink never returns (as seen across a cut link): the watchdog must end the rank
    from mpidist._comm import communicator

    communicator.shrink = lambda comm: time.sleep(3600)  # type: ignore[assignment]
strategy = md.MPIStrategy(
    device="cpu", timeout=3 if scenario == "stuck" else 60, piece_bytes=128 * 1024, fault_tolerance=tolerant, **levels
)
first_rank, first_size = strategy.rank, strategy.num_replicas_in_sync
outcome: dict = {"rank": first_rank, "failures": [], "sums": []}
size = {
    "allreduce": 4,
    "off": 4,
    "stuck": 4,
    "pipelined": 1 << 20,
    "inplace": 1 << 20,
    "update": 1 << 20,
    "compressed": 1 << 20,
}
size = size.get(scenario, 1000)
dtype = np.float32 if scenario == "compressed" else np.float64
size = 1 if scenario == "input" else size
with strategy.scope():
    a = md.Variable(np.zeros(size, dtype), name="a", aggregation="mean")
    b = md.Variable(np.zeros(size, dtype), name="b", aggregation="mean")
    seen = md.Sum("seen")  # a sync-on-read metric: the dead rank's part of it is lost


def mirrored_step(x: float) -> None:
    a.assign_add(np.full(size, x))
    b.assign_add(np.full(size, 2 * x))
    seen.update_state(np.ones(1))


def lost_warnings() -> list[str]:
    """The warnings a read of the metric gives (collective)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen.result()
    return [str(w.message) for w in caught]


x = np.linspace(0.0, 1.0, 600)
data = md.ArrayDataset((x, 3.0 * x), global_batch_size=60, shuffle=True, seed=0)


def input_step(batch: tuple) -> None:  # a += 1 per step; b: the least-squares slope of y = 3 x, from 0
    xs, ys = batch
    a.assign_add(np.ones(1))
    b.assign_sub(np.array([np.mean((b.read_value() * xs - ys) * xs)]))


if scenario == "input":  # three epochs of ten steps over a distributed dataset, its position in the snapshot
    dataset = strategy.distribute_dataset(data)
    epoch, position = 0, None
    while epoch < 3:
        try:
            started = time.time()
            dataset.set_epoch(epoch)
            iterator = dataset.iterator_from_state(position) if position else iter(dataset)
            strategy.snapshot(epoch=epoch, position=iterator.get_state())
            for batch in iterator:
                strategy.run(input_step, args=(batch,))
                strategy.snapshot(epoch=epoch, position=iterator.get_state())
                if outcome["failures"] and "next_step_at" not in outcome:
                    outcome["next_step_at"] = time.time()
            epoch, position = epoch + 1, None
        except md.RankFailedError as failure:
            raised = time.time()
            state = strategy.recover()
            dataset = strategy.distribute_dataset(data)
            epoch, position = state["epoch"], state["position"]
            outcome["failures"].append(
                {
                    "failed_ranks": list(failure.failed_ranks),
                    "size": failure.size,
                    "raised_at": raised,
                    "call_started_at": started,
                    "recovered_in": time.time() - raised,
                    "message": str(failure),
                }
            )
if scenario in ("inplace", "update", "compressed"):  # no snapshot: the call in flight lands whole or not at all
    for _ in range(8):
        buffer = np.ones(size)
        try:
            if scenario == "inplace":
                strategy.communicator.allreduce(buffer, inplace=True, name="buffer")
            else:
                strategy.run(lambda: a.assign_add(np.ones(size, dtype)))
        except md.RankFailedError as failure:
            raised = time.time()
            strategy.recover()
            outcome["failures"].append(
                {
                    "failed_ranks": list(failure.failed_ranks),
                    "size": failure.size,
                    "raised_at": raised,
                    "message": str(failure),
                }
            )
            # the reduction that raised left its buffer as it was; every survivor's variable whole, before or after
            outcome["buffer"] = [float(buffer.min()), float(buffer.max())]
            outcome["whole"] = [float(a.component.min()), float(a.component.max())]
            break
if scenario == "split":  # process sets of two ranks: the set that lost a rank and the whole recover each on its own
    group = strategy.split(first_rank // 2)
    assert group is not None
    outcome["split"] = []
    for step in range(6):
        row: list = [step]
        for name, s in (("set", group), ("all", strategy)):
            try:
                row.append([name, float(s.reduce("sum", np.ones(3))[0]), s.num_replicas_in_sync])
            except md.RankFailedError as failure:
                s.recover()
                row.append([name, "recovered", list(failure.failed_ranks), s.num_replicas_in_sync])
        outcome["split"].append(row)
checkpoint = md.Checkpoint(a=a, b=b)
step, steps = 0, 0 if scenario in ("input", "inplace", "update", "compressed", "split") else 8
while step < steps:
    try:
        started = time.time()
        if outcome["failures"] and os.environ.get("FT_DIE_AFTER_RECOVERY") == str(first_rank):
            os.kill(os.getpid(), signal.SIGKILL)  # a second failure, after the survivors recovered from the first
        if scenario in ("mirrored", "checkpoint"):
            strategy.snapshot(step=step)
            strategy.run(mirrored_step, args=(float(step + 1),))
            if scenario == "checkpoint":
                checkpoint.save(os.path.join(os.environ["FT_OUT"], "ckpt"), keep=2)
        else:
            total = strategy.reduce("sum", np.ones(size))
            outcome["sums"].append([step, float(total.min()), float(total.max()), strategy.num_replicas_in_sync])
        step += 1
        if outcome["failures"] and "next_step_at" not in outcome:
            outcome["next_step_at"] = time.time()
    except md.CommError as failure:
        if not isinstance(failure, md.RankFailedError):  # this side stops (a CutOffError), or fault tolerance is off
            if tolerant:
                raise
            # every survivor: a clear error, never a raw MPI exception; the communicator is done
            outcome["error"] = f"{type(failure).__name__}: {failure}"
            break
        raised = time.time()
        if os.environ.get("FT_DIE_IN_RECOVERY") == str(first_rank):  # a second death, met in the others' recover()
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("FT_COLLECTIVES_BEFORE_RECOVERY") and "refused" not in outcome:
            outcome["refused"] = []
            for attempt in (
                lambda: strategy.reduce("sum", np.ones(3)),
                lambda: strategy.run(lambda: a.assign_add(np.ones(size))),
                seen.result,
            ):
                try:
                    attempt()
                    outcome["refused"].append("ran")
                except md.RankFailedError as refused:
                    outcome["refused"].append([list(refused.failed_ranks), str(refused)])
        state = strategy.recover()
        step = state.get("step", step)
        outcome["failures"].append(
            {
                "failed_ranks": list(failure.failed_ranks),
                "size": failure.size,
                "raised_at": raised,
                "call_started_at": started,
                "recovered_in": time.time() - raised,
                "message": str(failure),
            }
        )
if scenario == "mirrored":  # the metric says it lost the dead rank's part, until it is reset
    outcome["lost"] = lost_warnings()
    seen.reset_state()
    outcome["lost_after_reset"] = lost_warnings()
if scenario == "off":
    with open(os.path.join(os.environ["FT_OUT"], f"rank{first_rank}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the communicator is unusable: no exit hook, no departure announced
if scenario == "checkpoint":  # the newest save holds the last step's values, readable by the survivors
    with strategy.scope():
        fresh = [md.Variable(np.zeros(size), name=f"fresh_{n}", aggregation="mean") for n in "ab"]
    md.Checkpoint(a=fresh[0], b=fresh[1]).restore(os.path.join(os.environ["FT_OUT"], "ckpt"))
    outcome["restored"] = [float(v.component[0]) for v in fresh]
outcome.update(
    final_rank=strategy.rank,
    final_size=strategy.num_replicas_in_sync,
    a=float(a.component[0]),
    b=float(b.component[0]),
    crc=[zlib.crc32(v.component.tobytes()) for v in (a, b)],
    check=strategy.check_mirrored([a, b]),
)
with open(os.path.join(os.environ["FT_OUT"], f"rank{first_rank}.json"), "w") as f:
    json.dump(outcome, f)
print(f"rank {first_rank} of {first_size}: now {strategy.rank} of {strategy.num_replicas_in_sync}", flush=True)
