"""tensorplay_hpc: the tensorplay.distributed.optim API on MPI."""

__version__ = "0.1.0"
