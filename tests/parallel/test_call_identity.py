"""The whole call is what the ranks agree on (at 1, 2 and 3 ranks, under each MPI).

Besides kind, op, dtype and shape: the structure and keys of a nest, the ``axis``, the update a
variable applies (kind, or the function of ``batch_update``), and, when the strategy is created,
the options that shape the collectives. Calls that are the same call agree: dtype aliases, and
the output form (a new array, ``out=``, in place) given on some ranks only. The last rank is the
one that differs; at one rank nothing can differ, and the call simply works. Every rank makes the
same collectives in the same order, so a failure is a failure and not a hang.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as md
from mpidist import CollectiveMismatchError, MPIStrategy, ReduceOp

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def strategy():
    s = MPIStrategy(device="cpu", abort_on_error=False, timeout=30)
    yield s
    s.free()


def last(strategy) -> bool:
    return strategy.num_replicas_in_sync > 1 and strategy.rank == strategy.num_replicas_in_sync - 1


def differs_on_the_last_rank(strategy, call, expected=None, words=()):
    """``call(odd)``: a mismatch on every rank when the last rank is odd (naming it), else ``expected``."""
    n = strategy.num_replicas_in_sync
    if n == 1:
        result = call(False)
        if expected is not None:
            expected(result)
        return
    with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}") as caught:
        call(last(strategy))
    for word in words:
        assert word in str(caught.value)
    # still usable: the next call agrees
    np.testing.assert_array_equal(strategy.reduce(ReduceOp.SUM, np.ones(2)), [n, n])


def test_nest_keys_that_differ(strategy):
    def call(odd):
        keys = ("err", "loss") if odd else ("acc", "loss")
        return strategy.reduce(ReduceOp.SUM, {k: np.ones(3) for k in keys})

    n = strategy.num_replicas_in_sync
    differs_on_the_last_rank(
        strategy,
        call,
        lambda r: np.testing.assert_array_equal(r["acc"], np.full(3, n)),
        ["reduce['acc']", "reduce['err']"] if n > 1 else [],
    )


def test_a_list_against_a_dict(strategy):
    def call(odd):
        value = {"a": np.ones(2), "b": np.ones(2)} if odd else [np.ones(2), np.ones(2)]
        return strategy.reduce(ReduceOp.SUM, value)

    differs_on_the_last_rank(strategy, call)


def test_one_leaf_nest_keys_that_differ(strategy):
    def call(odd):
        return strategy.reduce(ReduceOp.MEAN, {"b" if odd else "a": np.ones(2)})

    differs_on_the_last_rank(strategy, call)


def test_axis_that_differs(strategy):
    x = np.arange(9.0).reshape(3, 3)

    def call(odd):
        return strategy.reduce(ReduceOp.SUM, x, axis=1 if odd else 0)

    n = strategy.num_replicas_in_sync
    differs_on_the_last_rank(
        strategy, call, lambda r: np.testing.assert_array_equal(r, n * x.sum(axis=0)), ["axis=0", "axis=1"]
    )


def test_equivalent_axes_agree(strategy):
    x = np.arange(6.0).reshape(2, 3)
    got = strategy.reduce(ReduceOp.MEAN, x, axis=-1 if last(strategy) else 1)
    np.testing.assert_allclose(got, x.mean(axis=1))


def test_gather_axis_that_differs(strategy):
    x = np.zeros((3, 3))

    def call(odd):
        return strategy.gather(x, axis=1 if odd else 0)

    n = strategy.num_replicas_in_sync
    differs_on_the_last_rank(strategy, call, lambda r: np.testing.assert_array_equal(r.shape, (3 * n, 3)))


def test_an_axis_out_of_range_on_one_rank(strategy):
    n = strategy.num_replicas_in_sync
    if n == 1:
        pytest.skip("needs two ranks: the others' error names the rank whose axis is out of range")
    if last(strategy):
        with pytest.raises(ValueError, match=f"rank {n - 1}: axis 5 is out of range"):
            strategy.gather(np.zeros((2, 2)), axis=5)
    else:
        with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}"):
            strategy.gather(np.zeros((2, 2)), axis=0)


def test_update_kind_that_differs(strategy):
    with strategy.scope():
        v = md.Variable(np.array([5.0]), name="identity_v", aggregation=md.VariableAggregation.MEAN)

    def step():
        return v.assign_add([1.0]) if last(strategy) else v.assign([1.0])

    n = strategy.num_replicas_in_sync
    if n == 1:
        strategy.run(step)
        np.testing.assert_array_equal(v.numpy(), [1.0])
        return
    with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}") as caught:
        strategy.run(step)
    assert "assign_add" in str(caught.value) or "lambda" in str(caught.value)
    np.testing.assert_array_equal(v.numpy(), [5.0])  # nothing was applied, on any rank


def shrink(w, g):
    w -= 0.5 * g


def grow(w, g):
    w += 0.5 * g


def test_batch_update_functions_that_differ(strategy):
    with strategy.scope():
        a = md.Variable(np.ones(2), name="identity_a", aggregation=md.VariableAggregation.SUM)
        b = md.Variable(np.ones(3), name="identity_b", aggregation=md.VariableAggregation.SUM)
    n = strategy.num_replicas_in_sync

    def step():
        strategy.batch_update([(a, np.ones(2)), (b, np.ones(3))], grow if last(strategy) else shrink)

    if n == 1:
        strategy.run(step)
        np.testing.assert_array_equal(a.numpy(), [0.5, 0.5])
        return
    with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}") as caught:
        strategy.run(step)
    assert "shrink" in str(caught.value) and "grow" in str(caught.value)
    np.testing.assert_array_equal(a.numpy(), [1.0, 1.0])


def test_the_same_function_from_the_same_place_agrees(strategy):
    with strategy.scope():
        a = md.Variable(np.zeros(2), name="identity_same", aggregation=md.VariableAggregation.SUM)
    n = strategy.num_replicas_in_sync
    for scale in (1.0, 2.0):  # a new closure each time: captured values are not compared
        strategy.run(lambda s=scale: strategy.batch_update([(a, np.ones(2))], lambda w, g: w.__iadd__(s * g)))
    np.testing.assert_array_equal(a.numpy(), [3.0 * n, 3.0 * n])


def test_dtype_aliases_are_one_dtype(strategy):
    n = strategy.num_replicas_in_sync
    char = "l" if last(strategy) else "q"
    x = np.ones(4, dtype=np.dtype(char))
    assert x.dtype.char == char
    np.testing.assert_array_equal(strategy.communicator.allreduce(x, name="alias"), np.full(4, n))
    big = np.ones(1000, dtype=np.dtype(char))  # not carried in the record: a real reduction
    np.testing.assert_array_equal(strategy.communicator.allreduce(big, name="alias big"), np.full(1000, n))


def test_reduce_out_on_some_ranks_only(strategy):
    n = strategy.num_replicas_in_sync
    x = np.full(3, 2.0)
    out = np.empty(3)
    got = strategy.reduce(ReduceOp.SUM, x, out=out if last(strategy) else None)
    np.testing.assert_array_equal(got, np.full(3, 2.0 * n))
    if last(strategy):
        assert got is out
    nest = {"a": np.ones(2), "b": np.ones(5000)}
    outs = {"a": np.empty(2), "b": np.empty(5000)}
    got = strategy.reduce(ReduceOp.MEAN, nest, out=outs if strategy.rank == 0 else None)
    np.testing.assert_array_equal(got["b"], np.ones(5000))


def test_allreduce_output_forms_on_different_ranks(strategy):
    comm = strategy.communicator
    n = strategy.num_replicas_in_sync
    for size in (3, 300_000):  # carried in the record, and reduced in pieces
        x = np.full(size, float(comm.rank + 1))
        form = comm.rank % 3
        if form == 0:
            got = comm.allreduce(x, name="forms")
        elif form == 1:
            got = comm.allreduce(x, name="forms", out=np.empty(size))
        else:
            got = comm.allreduce(x, name="forms", inplace=True)
        np.testing.assert_array_equal(got, np.full(size, n * (n + 1) / 2))


@pytest.mark.parametrize(
    "options",
    [
        dict(check_collectives=False),  # the data always goes through the reduction algorithm
        dict(check_collectives=False, timeout=None),  # the blocking MPI calls
        dict(hierarchical=True, node_size=2),  # the two-level algorithm (blocking) and the flat one (nonblocking)
    ],
    ids=["flat", "flat-blocking-mpi", "hierarchical"],
)
def test_the_output_form_never_changes_the_mpi_calls(options):
    # MPI wants MPI_IN_PLACE on every rank of a reduction or on none: each rank reduces in place, whatever form
    s = MPIStrategy(device="cpu", abort_on_error=False, **{"timeout": 30, **options})
    comm, transport = s.communicator, s.communicator._transport
    seen: list[tuple[str, bool]] = []

    def spy(method: str, at: int):  # at: where the MPI function's name is among the arguments
        real = getattr(transport, method)

        def record(*args, **kwargs):
            seen.append((args[at], args[at + 1] is MPI.IN_PLACE))
            return real(*args, **kwargs)

        setattr(transport, method, record)

    spy("run", 1)
    spy("start", 0)
    n = s.num_replicas_in_sync
    try:
        for size in (3, 300_000):  # one call, and pieces
            for blocking in (True, False):
                x = np.full(size, float(comm.rank + 1))
                form = [{}, {"out": np.empty(size)}, {"inplace": True}][comm.rank % 3]
                call = comm.allreduce if blocking else comm.iallreduce
                got = call(x, name="forms", **form)
                got = got if blocking else got.wait()
                np.testing.assert_array_equal(got, np.full(size, n * (n + 1) / 2))
    finally:
        s.free()
    allreduces = [in_place for mpi_name, in_place in seen if mpi_name == "Allreduce"]
    assert n == 1 or (allreduces and all(allreduces)), seen


def test_allgather_out_on_some_ranks_only(strategy):
    comm = strategy.communicator
    n = strategy.num_replicas_in_sync
    out = np.empty((2 * n, 2)) if last(strategy) else None
    got = comm.allgather(np.full((2, 2), float(comm.rank)), name="gather out", out=out)
    np.testing.assert_array_equal(got[:, 0], np.repeat(np.arange(n, dtype=float), 2))
    if last(strategy):
        assert got is out


class NoFlags:
    """Array-like enough to be taken for an array until its flags are asked for (as a torch tensor)."""

    shape, dtype, ndim, size = (2,), np.dtype("float64"), 1, 2

    def __getattr__(self, name):
        raise AttributeError(f"NoFlags has no {name!r}")


def test_a_conversion_failing_with_any_exception_is_agreed(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = md.Variable(np.zeros(2), name="identity_conv", aggregation=md.VariableAggregation.SUM)

    class Weird:
        def __array__(self, *args, **kwargs):
            raise KeyError("conversion failed")

    value = Weird() if last(strategy) else np.ones(2)
    if n == 1:
        strategy.run(lambda: v.assign_add(np.ones(2)))
        return
    if last(strategy):
        with pytest.raises(KeyError, match="conversion failed"):
            strategy.run(lambda: v.assign_add(value))
    else:
        with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}.*KeyError"):
            strategy.run(lambda: v.assign_add(value))
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])


def test_a_name_that_differs_is_a_mismatch(strategy):
    n = strategy.num_replicas_in_sync

    def call(odd):
        return strategy.communicator.allreduce(np.ones(2), name="other" if odd else "grads")

    differs_on_the_last_rank(strategy, call, words=["'grads'", "'other'"] if n > 1 else [])


# -- creation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "mine", "theirs"),
    [
        ("hierarchical", True, False),
        ("check_collectives", False, True),
        ("fusion_bytes", 1024, 65536),
        ("fault_tolerance", True, False),
        ("compression", "bf16", None),
    ],
)
def test_options_that_differ_are_refused_at_creation(option, mine, theirs):
    world = MPI.COMM_WORLD
    n = world.size
    odd = n > 1 and world.rank == n - 1
    kwargs = {"device": "cpu", "abort_on_error": False, "timeout": 30, option: mine if odd else theirs}
    if n == 1:
        MPIStrategy(**kwargs).free()
        return
    with pytest.raises(CollectiveMismatchError) as caught:
        MPIStrategy(**kwargs)
    text = str(caught.value)
    assert f"{option} (" in text and f"rank {n - 1}: {mine!r}" in text, text
    md.MPIStrategy(device="cpu", abort_on_error=False, timeout=30).free()  # the next creation works


def test_a_bad_environment_variable_on_one_rank_raises_on_every_rank(monkeypatch):
    world = MPI.COMM_WORLD
    n = world.size
    odd = world.rank == n - 1
    monkeypatch.setenv("MPIDIST_TIMEOUT", "abc" if odd else "30")
    kwargs = {"device": "cpu", "abort_on_error": False}
    if odd:
        with pytest.raises(ValueError, match="abc"):
            MPIStrategy(**kwargs)
    else:
        with pytest.raises(CollectiveMismatchError, match=f"rank {n - 1}.*abc"):
            MPIStrategy(**kwargs)
    monkeypatch.setenv("MPIDIST_TIMEOUT", "30")
    md.MPIStrategy(device="cpu", abort_on_error=False).free()
