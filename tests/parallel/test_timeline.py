"""The timeline inside a job (under mpiexec): off, nothing is installed; on, every collective is written.

Whole jobs with ``MPIDIST_TIMELINE`` and the merge command: ``test_timeline_jobs.py``.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from mpidist._comm.agreement import Agreement
from mpidist._comm.transport import Transport
from mpidist._tools.timeline import agreements, read_directory, read_trace

pytestmark = pytest.mark.mpi


def test_off_by_default_nothing_is_installed():
    strategy = md.MPIStrategy(device="cpu")
    comm = strategy.communicator
    assert comm.timeline is None
    assert type(comm._agreement) is Agreement and type(comm._transport) is Transport
    assert "run" not in vars(strategy) and not {"iallreduce", "iallreduce_many"} & set(vars(comm))
    strategy.free()


def test_the_option_may_differ_between_ranks(shared_tmp):
    mine = str(shared_tmp) if MPI.COMM_WORLD.rank == 0 else None
    strategy = md.MPIStrategy(device="cpu", timeline=mine)
    assert (strategy.communicator.timeline is not None) == (strategy.rank == 0)
    assert np.asarray(strategy.reduce("sum", np.ones(2))).tolist() == [strategy.num_replicas_in_sync] * 2
    strategy.free()


def test_every_rank_of_the_job_writes_the_same_job_identity(shared_tmp):
    strategy = md.MPIStrategy(device="cpu", timeline=str(shared_tmp))
    strategy.reduce("sum", np.ones(2))
    strategy.free()
    MPI.COMM_WORLD.Barrier()  # every file written
    jobs = {trace.job for trace in read_directory(str(shared_tmp)).values()}
    assert len(jobs) == 1 and None not in jobs  # each rank reads every rank's file


def test_a_timeline_that_cannot_be_written_raises_on_every_rank_naming_the_rank(shared_tmp):
    blocker = shared_tmp / "a-file"
    if MPI.COMM_WORLD.rank == 0:
        blocker.write_text("not a directory")
    MPI.COMM_WORLD.Barrier()
    mine = str(blocker) if MPI.COMM_WORLD.rank == 0 else None  # rank 0 alone asks for a path it cannot use
    with pytest.raises((FileExistsError, md.CollectiveMismatchError)) as caught:
        md.MPIStrategy(device="cpu", timeline=mine, abort_on_error=False)
    if MPI.COMM_WORLD.rank == 0:
        assert caught.type is FileExistsError and caught.value.errno == 17
        assert str(caught.value) == f"rank 0: timeline {str(blocker)!r}: File exists"
    else:
        assert "rank 0" in str(caught.value) and "File exists" in str(caught.value)


def test_the_merge_pairs_the_same_communicator_when_ranks_recorded_different_ones(shared_tmp):
    # the option is local: rank 0 records a first strategy that the others do not record, then every rank records
    # a second one; each collective of the second must be paired with the same collective on every rank, not
    # with rank 0's collectives of the first (its first communicator over every rank, theirs the second)
    world = MPI.COMM_WORLD
    first = md.MPIStrategy(device="cpu", timeline=str(shared_tmp) if world.rank == 0 else None)
    for _ in range(3):
        first.reduce("sum", {"first": np.ones(2)})
    first.free()
    second = md.MPIStrategy(device="cpu", timeline=str(shared_tmp))
    for _ in range(3):
        second.reduce("sum", {"second": np.ones(2)})
    second.free()
    world.Barrier()  # every file written
    traces = read_directory(str(shared_tmp))
    named = {
        rank: {
            (world_number, e["args"]["seq"]): e["args"]["name"]
            for e in trace.events
            if e.get("cat") == "wait" and (world_number := trace.world_tracks.get(e["tid"])) is not None
        }
        for rank, trace in traces.items()
    }
    assert sorted(traces) == list(range(world.size))
    for rank in traces:
        common = named[0].keys() & named[rank].keys()
        assert agreements(traces[0]).keys() & agreements(traces[rank]).keys() == common
        assert "reduce['second']" in {named[rank][k] for k in common}
        assert all(named[0][k] == named[rank][k] for k in common), (rank, sorted(common))


# Every kind of collective, in the order make_every_collective makes them: (the name its events carry, whether its
# data moves after the agreement at more than one rank)
KINDS = [
    ("one", False),  # an 8-byte allreduce: its data rides in the agreement's record
    ("many", True),
    ("2 arrays ('fused', 'fused-b')", False),  # a fused reduction, named by its arrays
    ("rows", True),
    ("three", True),
    ("split", True),
    ("even", False),  # a small even alltoall: its rows ride in the record
    ("large", True),
    ("part", True),
    ("collected", True),
    ("dealt", True),
    ("later", False),
    ("i-three", True),
    ("i-rows", True),
    ("i-part", True),
    ("i-even", False),
    ("2 arrays ('i-fused', 'i-fused-b')", False),
    ("barrier", False),
]


def make_every_collective(comm) -> None:
    n, rank = comm.size, comm.rank
    comm.allreduce(np.ones(1), name="one")
    comm.allreduce(np.ones(1 << 16, np.float32), name="many")
    comm.allreduce_many([np.ones(1), np.ones(2)], names=["fused", "fused-b"])
    comm.allgather(np.ones(2), name="rows")
    comm.broadcast(np.ones(3), name="three")
    comm.alltoall(np.ones(n + rank), [1] * (n - 1) + [1 + rank], name="split")
    comm.alltoall(np.ones(n), name="even")
    comm.alltoall(np.ones((n, 1 << 12)), name="large")
    comm.reduce_scatter(np.ones((n, 1 << 12)), name="part")
    comm.gather(np.ones(2), name="collected")
    comm.scatter([np.ones(2)] * n if rank == 0 else None, name="dealt")
    comm.iallreduce(np.ones(2), name="later").wait()
    comm.ibroadcast(np.ones(3), name="i-three").wait()
    comm.iallgather(np.ones(2), name="i-rows").wait()
    comm.ireduce_scatter(np.ones((n, 1 << 12)), name="i-part").wait()
    comm.ialltoall(np.ones(n), name="i-even").wait()
    comm.iallreduce_many([np.ones(1), np.ones(2)], names=["i-fused", "i-fused-b"]).wait()
    comm.barrier()


def test_every_collective_is_written_once_the_communicator_is_freed(shared_tmp):
    strategy = md.MPIStrategy(device="cpu", timeline=shared_tmp)  # a path, as MPIDIST_TIMELINE names it
    comm, n = strategy.communicator, strategy.num_replicas_in_sync
    made = []
    for _ in range(2):  # twice: lazily made plans and templates
        first = comm._transport.seq + 1
        make_every_collective(comm)
        made.append(range(first, comm._transport.seq + 1))
    strategy.free()
    trace = read_trace(str(comm.timeline.path))
    agreements = [e for e in trace.events if e.get("cat") in ("wait", "in flight")]
    seqs = {e["args"]["seq"]: e for e in agreements}
    transfers = {e["args"]["seq"] for e in trace.events if e.get("cat") == "transfer"}
    # every collective, each once; the process's first communicator may start with a collective made before its
    # agreement exists (the choice of an MPI setting), which is its transfer alone
    assert len(agreements) == len(seqs) and set(seqs) | transfers == set(range(1, made[-1][-1] + 1))
    assert set(range(2, made[-1][-1] + 1)) <= set(seqs)
    last = [seqs[s] for s in made[-1]]
    assert [e["args"]["name"] for e in last] == [name for name, _ in KINDS]  # one collective each
    nonblocking = {e["args"]["name"] for e in last if e["cat"] == "in flight"}
    assert nonblocking == {name for name, _ in KINDS if "i-" in name or name == "later"}
    # a nonblocking collective's data moves in its handle's wait(); one rank's reduction moves none
    moved = {name for name, moves in KINDS if moves and name not in nonblocking and (n > 1 or name != "many")}
    assert {seqs[s]["args"]["name"] for s in transfers if s in made[-1]} == moved
    waits = [e["args"]["seq"] for e in trace.events if e.get("cat") == "handle"]
    assert set(waits) >= {seqs[s]["args"]["seq"] for s in made[-1] if seqs[s]["cat"] == "in flight"}
    assert {e["pid"] for e in trace.events} == {comm.timeline.rank} and trace.size == n


def test_a_collective_recorded_twice_is_one_event_and_nonblocking_ones_are_in_flight(shared_tmp):
    # check_finite sends the mirrored update through the agreement's general path, which the per-collective path
    # calls: both record the collective, and the file holds it once
    strategy = md.MPIStrategy(device="cpu", timeline=str(shared_tmp), check_finite=True)
    comm = strategy.communicator
    with strategy.scope():
        v = md.Variable(np.zeros(2), aggregation=md.VariableAggregation.MEAN, name="v")
    first = comm._transport.seq + 1
    handle = comm.iallreduce(np.ones(3), name="started")
    with strategy.scope():
        for _ in range(5):
            strategy.run(lambda: v.assign_add(np.ones(2)))  # completes the nonblocking agreement first
    handle.wait()
    made = comm._transport.seq
    strategy.free()
    events = [e for e in read_trace(str(comm.timeline.path)).events if e.get("cat") in ("wait", "in flight")]
    seqs = [e["args"]["seq"] for e in events if e["args"]["seq"] >= first]
    assert sorted(seqs) == list(range(first, made + 1))  # each once
    kinds = {e["args"]["seq"]: (e["cat"], e["args"]["name"]) for e in events}
    assert kinds[first] == ("in flight", "started")
    assert {kinds[s] for s in range(first + 1, made + 1)} == {("wait", "v")}
    steps = [e for e in read_trace(str(comm.timeline.path)).events if e.get("cat") == "step"]
    assert len(steps) >= 5
