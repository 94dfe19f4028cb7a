"""Serial tests of options, reduce ops, error formatting and backend selection."""
from __future__ import annotations

import numpy as np
import pytest

from mpidist import CollectiveMismatchError, CollectiveTimeoutError, MpidistError, Options, ReduceOp
from mpidist._comm.backend import Backend, contiguous, cupy_or_none, to_host
from mpidist._errors import format_ranks


def test_options_precedence_keyword_over_environment_over_default():
    env = {"MPIDIST_TIMEOUT": "30", "MPIDIST_PIPELINE_BYTES": "65536", "MPIDIST_DEVICE": "CPU"}
    opts = Options.resolve(env=env, timeout=5)
    assert opts.timeout == 5 and opts.pipeline_bytes == 65536 and opts.device == "cpu"
    assert Options.resolve(env={}) == Options()
    assert Options.resolve(env={"MPIDIST_TIMEOUT": "off"}).timeout is None


@pytest.mark.parametrize("kwargs, text", [
    ({"timeout": -1}, "timeout must be a positive"),
    ({"pipeline_bytes": 10}, "pipeline_bytes must be at least 1024"),
    ({"device": "tpu"}, "expected one of auto, cpu, gpu"),
    ({"cuda_aware": "maybe"}, "expected one of auto, 1, 0"),
    ({"colour": 1}, "unknown mpidist option"),
])
def test_options_reject_bad_values(kwargs, text):
    with pytest.raises(ValueError, match=text):
        Options.resolve(env={}, **kwargs)


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


@pytest.mark.parametrize("ranks, text", [([], ""), ([2], "2"), ([0, 1, 2, 5], "0-2, 5"), ([7, 3, 4], "3-4, 7")])
def test_format_ranks(ranks, text):
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
