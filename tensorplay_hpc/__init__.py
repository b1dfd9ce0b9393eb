"""tensorplay_hpc: the tensorplay.distributed.optim API on MPI."""
