"""The comm layer: the only part of mpidist that moves data through MPI (see :mod:`~mpidist._comm.communicator`)."""

from mpidist._comm.tuning import tune_before_init

tune_before_init()
