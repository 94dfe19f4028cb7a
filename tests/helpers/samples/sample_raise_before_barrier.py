"""Rank 1 raises while rank 0 waits in a barrier for it.

Under ``python -m mpi4py`` rank 1's non-zero exit aborts the job; without it rank 0 would
wait in the barrier forever.
"""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_raises_on_rank_1_before_barrier():
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        raise RuntimeError("deliberate error on rank 1, before the barrier")
    comm.Barrier()
