"""mpidist: distributed values and variables for NumPy/CuPy SPMD programs on MPI."""
from mpidist._errors import CollectiveMismatchError, CollectiveTimeoutError, CommError, MpidistError
from mpidist._version import __version__

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommError",
    "MpidistError",
    "__version__",
]
