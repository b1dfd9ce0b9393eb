"""An MPI job that goes wrong on purpose, for the reliability tests.

    fault_job.py stall    the last rank sleeps while the others enter an allreduce (rank 0
                          prints the time, ``time.time()``, at which it enters)
    fault_job.py raise    the last rank raises while the others enter an allreduce
"""
import sys
import time

import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.abort import abort_on_exception


def main(mode):
    abort_on_exception()
    MPI.COMM_WORLD.Barrier()    # start together: under load, the ranks' imports end seconds apart
    group = comm.ProcessGroup()
    comm.all_reduce(torch.ones(4), group.comm)          # everyone arrives once
    if group.rank == group.size - 1:
        if mode == "stall":
            time.sleep(120)
        else:
            raise RuntimeError("deliberate failure on the last rank")
    if group.rank == 0:
        print(f"entering the stalled collective at {time.time()}", flush=True)
    comm.all_reduce(torch.ones(4), group.comm)
    print("not reached", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
