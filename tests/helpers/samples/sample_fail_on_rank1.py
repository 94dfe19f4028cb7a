"""One assertion that fails on rank 1 only: the job must exit non-zero."""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_fails_on_rank_1_only():
    rank = MPI.COMM_WORLD.Get_rank()
    assert rank != 1, "deliberate failure on rank 1"
