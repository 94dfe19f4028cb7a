"""Serial tests of options, reduce ops, error formatting and backend selection."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist import CollectiveMismatchError, CollectiveTimeoutError, MpidistError, Options, ReduceOp
from mpidist._comm.backend import Backend, contiguous, cupy_or_none, to_host
from mpidist._errors import format_ranks


def test_options_precedence_keyword_over_environment_over_default():
    env = {"MPIDIST_TIMEOUT": "30", "MPIDIST_PIECE_BYTES": "65536", "MPIDIST_DEVICE": "CPU"}
    opts = Options.resolve(env=env, timeout=5)
    assert opts.timeout == 5 and opts.piece_bytes == 65536 and opts.device == "cpu"
    assert Options.resolve(env={}) == Options()
    assert Options.resolve(env={"MPIDIST_TIMEOUT": "off"}).timeout is None


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"timeout": -1}, "timeout must be a positive"),
        ({"piece_bytes": 10}, "piece_bytes must be at least 1024"),
        ({"device": "tpu"}, "expected one of auto, cpu, gpu"),
        ({"cuda_aware": "maybe"}, "expected one of auto, 1, 0"),
        ({"colour": 1}, "unknown mpidist option"),
        ({"straggler_threshold": 0}, "straggler_threshold and straggler_window must be > 0 and >= 1"),
        ({"straggler_window": 0}, "straggler_threshold and straggler_window must be > 0 and >= 1"),
        ({"straggler_interval": -5}, "straggler_interval must be a positive number of seconds or None"),
        ({"compression": "fp8"}, "option compression: expected none, fp16 or bf16, got 'fp8'"),
    ],
)
def test_options_reject_bad_values(kwargs, text):
    with pytest.raises(ValueError, match=text):
        Options.resolve(env={}, **kwargs)


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"timeout": True}, "option timeout must be a number of seconds or None, got True"),
        ({"piece_bytes": 2.5e6}, "option piece_bytes must be an integer"),
        ({"check_collectives": "no"}, "option check_collectives must be True or False, got 'no'"),
        ({"node_size": 2.0}, "option node_size must be an integer"),
        ({"hierarchical": 1}, r"option hierarchical must be True, False or None \(auto\)"),
        ({"straggler_window": 128.0}, "option straggler_window must be an integer number of collectives"),
        ({"straggler_threshold": "20%"}, "option straggler_threshold must be a number"),
        ({"compression": True}, 'option compression must be "fp16", "bf16", "none" or None'),
    ],
)
def test_options_of_the_wrong_type_raise_type_error_naming_the_option(kwargs, text):
    with pytest.raises(TypeError, match=text):
        Options.resolve(env={}, **kwargs)


def test_compression_from_keyword_or_environment_none_is_exact():
    assert Options().compression is None
    assert Options.resolve(env={"MPIDIST_COMPRESSION": "BF16"}).compression == "bf16"
    assert Options.resolve(env={"MPIDIST_COMPRESSION": "bf16"}, compression="fp16").compression == "fp16"
    assert Options.resolve(env={"MPIDIST_COMPRESSION": "fp16"}, compression="none").compression is None
    assert Options.resolve(env={"MPIDIST_COMPRESSION": "none"}).compression is None
    with pytest.raises(ValueError, match="environment variable MPIDIST_COMPRESSION: expected none, fp16 or bf16"):
        Options.resolve(env={"MPIDIST_COMPRESSION": "half"})


def test_former_name_pipeline_bytes_still_works_and_warns():
    """``pipeline_bytes`` / ``MPIDIST_PIPELINE_BYTES`` were renamed ``piece_bytes`` / ``MPIDIST_PIECE_BYTES``."""
    with pytest.warns(DeprecationWarning, match="option pipeline_bytes is deprecated: it was renamed piece_bytes"):
        assert Options.resolve(env={}, pipeline_bytes=4096).piece_bytes == 4096
    with pytest.warns(DeprecationWarning, match="option pipeline_bytes is deprecated: it was renamed piece_bytes"):
        assert Options(pipeline_bytes=8192) == Options(piece_bytes=8192)
    old, new = "MPIDIST_PIPELINE_BYTES", "MPIDIST_PIECE_BYTES"
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: it was renamed {new}"):
        assert Options.resolve(env={old: "65536"}).piece_bytes == 65536
    with pytest.warns(DeprecationWarning, match=old):  # the new variable wins
        assert Options.resolve(env={old: "65536", new: "4096"}).piece_bytes == 4096
    with pytest.warns(DeprecationWarning, match="Options.pipeline_bytes is deprecated: it was renamed piece_bytes"):
        assert Options(piece_bytes=2048).pipeline_bytes == 2048
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass only piece_bytes"):
        Options.resolve(env={}, pipeline_bytes=4096, piece_bytes=8192)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="pass only piece_bytes"):
        Options(pipeline_bytes=4096, piece_bytes=8192)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="piece_bytes must be at least 1024"):
        Options.resolve(env={}, pipeline_bytes=10)


def test_default_deadline_is_finite_and_zero_turns_it_off():
    assert Options().timeout == 600.0
    for text in ("0", "0.0", "none", "off"):
        assert Options.resolve(env={"MPIDIST_TIMEOUT": text}).timeout is None
    assert Options.resolve(env={}, timeout=0).timeout is None
    assert Options.resolve(env={}, timeout=None).timeout is None


def test_straggler_options_come_from_the_environment_and_zero_turns_the_lines_off():
    assert (Options().straggler_threshold, Options().straggler_window, Options().straggler_interval) == (0.2, 128, 60)
    env = {"MPIDIST_STRAGGLER_THRESHOLD": "0.5", "MPIDIST_STRAGGLER_WINDOW": "64", "MPIDIST_STRAGGLER_INTERVAL": "off"}
    opts = Options.resolve(env=env)
    assert (opts.straggler_threshold, opts.straggler_window, opts.straggler_interval) == (0.5, 64, None)
    assert Options.resolve(env={}, straggler_interval=0).straggler_interval is None


def test_misspelt_environment_variables_warn_once_with_the_closest_option(recwarn):
    env = {
        "MPIDIST_TIMEOUTS": "3",
        "MPIDIST_TEST_DEVICE": "standin",
        "MPIDIST_SLURM_CPUS": "2",
        "MPIDIST_LAUNCHER": "srun",
        "MPIDIST_SRUN_MPI": "pmix",
        "MPIDIST_VENV": "/x",
        "MPIDIST_MPIEXEC": "mpiexec",
        "MPIDIST_CHECK_FINITE": "1",
    }
    Options.resolve(env=env)
    Options.resolve(env=env)
    messages = [str(w.message) for w in recwarn.list if issubclass(w.category, UserWarning)]
    assert messages == ["environment variable MPIDIST_TIMEOUTS is not an mpidist option; did you mean MPIDIST_TIMEOUT?"]


def test_environment_errors_name_the_variable():
    with pytest.raises(ValueError, match="MPIDIST_CHECK"):
        Options.resolve(env={"MPIDIST_CHECK": "perhaps"})


def test_reduce_op_accepts_names():
    assert ReduceOp.of("SUM") is ReduceOp.SUM and ReduceOp.of(ReduceOp.MEAN) is ReduceOp.MEAN
    with pytest.raises(ValueError, match="unknown reduce op 'avg'"):
        ReduceOp.of("avg")


def test_error_hierarchy():
    assert issubclass(CollectiveMismatchError, (MpidistError, ValueError))
    assert issubclass(CollectiveTimeoutError, (MpidistError, RuntimeError))
    err = CollectiveTimeoutError("late", [3, 1])
    assert err.missing_ranks == (3, 1)


@pytest.mark.parametrize(
    "ranks, text",
    [
        ([], ""),
        ([2], "2"),
        ([0, 1, 2, 5], "0-2, 5"),
        ([7, 3, 4], "3-4, 7"),
        ([0, 2, 4, 6], "0-6:2"),
        ([1, 3], "1, 3"),
        (range(0, 10000, 2), "0-9998:2"),
        ([r * r for r in range(30)], None),
    ],
)
def test_format_ranks(ranks, text):
    if text is None:  # no pattern: the groups are capped and the rest counted
        assert format_ranks(ranks).endswith(f"... ({len(ranks)} ranks in all)") and len(format_ranks(ranks)) < 120
    else:
        assert format_ranks(ranks) == text


def test_cpu_backend_and_helpers():
    b = Backend.select("cpu", local_rank=3)
    assert b.xp is np and not b.is_gpu and b.name == "numpy"
    a = np.arange(6.0).reshape(2, 3)
    assert contiguous(a) is a and contiguous(a.T).flags.c_contiguous and contiguous(np.array(1.0)).ndim == 0
    assert to_host(a) is a
    assert b.to_mpi(a, cuda_aware=False) is a


def test_gpu_request_without_a_gpu_says_what_to_install():
    if cupy_or_none() is not None:
        pytest.skip("a GPU is present: device='gpu' succeeds here (covered by -m gpu tests)")
    with pytest.raises(RuntimeError, match=r"mpidist\[cuda12\]' or 'mpidist\[cuda13\]"):
        Backend.select("gpu")
    assert Backend.select("auto").xp is np


@pytest.mark.parametrize(
    "size,chosen,mpi_started,expected",
    [
        ("2", None, False, "1"),  # fewer than 4 ranks: the ring
        ("3", None, False, "1"),
        ("4", None, False, None),  # 4 ranks and more: Open MPI's own choice
        ("", None, False, None),  # not launched by Open MPI
        ("2", "3", False, "3"),  # the user's choice stays
        ("2", None, True, None),  # MPI already started: too late to matter, nothing set
    ],
)
def test_open_mpi_nonblocking_allreduce_algorithm_is_chosen_before_mpi_starts(
    monkeypatch, size, chosen, mpi_started, expected
):
    import os
    import sys

    from mpidist._comm import tuning

    var = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what it sets must not reach later tests' jobs
    monkeypatch.setattr(tuning, "_env_set", False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", size)
    if chosen is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, chosen)
    if not mpi_started:
        monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", sys.modules.get("mpi4py.MPI", object()))
    tuning.tune_before_init()
    assert os.environ.get(var) == expected
    assert tuning._env_set == (expected is not None and chosen is None)  # known as mpidist's own, not the user's
