"""Collectives that pass at any number of ranks."""

import pytest
from mpi4py import MPI


@pytest.mark.mpi
def test_allreduce_of_ranks():
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    assert comm.allreduce(comm.Get_rank()) == size * (size - 1) // 2
    comm.Barrier()
