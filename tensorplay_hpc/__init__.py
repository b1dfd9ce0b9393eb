"""tensorplay_hpc: the tensorplay.distributed.optim API on MPI."""

__all__ = ["__version__"]

__version__ = "0.1.0"
