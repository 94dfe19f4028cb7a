"""mpidist: distributed values and variables for NumPy/CuPy SPMD programs on MPI.

One MPI rank is one *replica*. Each rank holds its component of every
distributed value (a NumPy array, or a CuPy array on the rank's GPU);
aggregation is an MPI allreduce on those arrays; cross-replica code is a set
of collective calls that every rank makes in the same order.
"""

from mpidist._checkpoint.checkpoint import Checkpoint, read_checkpoint
from mpidist._comm.communicator import Communicator, Handle
from mpidist._comm.reduce_op import ReduceOp
from mpidist._distribute.context import ReplicaContext, get_replica_context, get_strategy, in_cross_replica_context
from mpidist._distribute.metrics import Accuracy, Mean, Sum
from mpidist._distribute.strategy import MPIStrategy
from mpidist._distribute.variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from mpidist._errors import (
    CheckpointError,
    ChecksumError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommError,
    CutOffError,
    IntegerOverflowError,
    MirrorDivergenceError,
    MpidistError,
    NonFiniteError,
    RankFailedError,
    RankLeftError,
)
from mpidist._input.datasets import ArrayDataset, FileDataset, InputContext
from mpidist._input.distributed import DistributedDataset, DistributedIterator
from mpidist._input.multistep import MultiStepContext
from mpidist._options import Options
from mpidist._values.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    regroup,
    select_replica,
    select_replica_mirrored,
)
from mpidist._version import __version__

__all__ = [
    "Accuracy",
    "ArrayDataset",
    "Checkpoint",
    "CheckpointError",
    "ChecksumError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommError",
    "Communicator",
    "CutOffError",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "DistributedVariable",
    "FileDataset",
    "Handle",
    "InputContext",
    "IntegerOverflowError",
    "MPIStrategy",
    "Mean",
    "Mirrored",
    "MirrorDivergenceError",
    "MirroredVariable",
    "MpidistError",
    "MultiStepContext",
    "NonFiniteError",
    "Options",
    "PerReplica",
    "RankFailedError",
    "RankLeftError",
    "ReduceOp",
    "ReplicaContext",
    "Sum",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "__version__",
    "get_replica_context",
    "get_strategy",
    "in_cross_replica_context",
    "read_checkpoint",
    "regroup",
    "select_replica",
    "select_replica_mirrored",
]
