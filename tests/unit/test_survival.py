"""What ``survival.readiness`` says about a job (doctor's ``dead ranks`` row), from the ranks' environment."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpidist._comm.survival import readiness

ULFM = hasattr(MPI.Comm, "Shrink") and getattr(MPI, "ERR_PROC_FAILED", MPI.ERR_UNKNOWN) != MPI.ERR_UNKNOWN


@pytest.mark.skipif(not ULFM, reason="this MPI has no ULFM: readiness says the job ends")
@pytest.mark.parametrize(
    "env,ready,says",
    [
        ({}, False, "start it with mpiexec --with-ft ulfm"),
        ({"OMPI_MCA_mpi_ft_enable": "1"}, True, "failure detector is off: a node cut off"),
        (
            {"OMPI_MCA_mpi_ft_enable": "true", "OMPI_MCA_mpi_ft_detector": "true"},
            True,
            "failure detector is on (timeout 10 s)",
        ),
        (
            {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_mpi_ft_detector": "1", "OMPI_MCA_mpi_ft_detector_timeout": "2"},
            True,
            "failure detector is on (timeout 2 s)",
        ),
    ],
)
def test_readiness_names_the_launch_and_the_failure_detector(env, ready, says):
    can, why = readiness(env)
    assert can is ready and says in why, why


@pytest.mark.skipif(ULFM, reason="this MPI has ULFM")
def test_readiness_without_ulfm_says_the_job_ends():
    can, why = readiness({"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_mpi_ft_detector": "true"})
    assert not can and why.startswith("end the job: this MPI library has no ULFM"), why
