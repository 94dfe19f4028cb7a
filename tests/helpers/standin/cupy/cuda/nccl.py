"""Stand-in ``cupy.cuda.nccl``: NCCL is not available."""

available = False
