"""A training loop that goes wrong on purpose at step 3, for the fault tests. It installs
nothing of its own: ending the job is the library's doing.

    training_fault_job.py zero    the last rank raises in a ZeroRedundancyOptimizer training loop
    training_fault_job.py ddp     the last rank raises in a DistributedDataParallel training loop
    training_fault_job.py hook    a DDP communication hook raises on the last rank
    training_fault_job.py save    PyTorch's idiom: rank 0 alone saves a checkpoint (into the
                                  folder given next), the others go on to a barrier

The rank that goes wrong prints the time (``time.time()``) at which it does.
"""
import os
import sys
import time

import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks import default_hooks
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

FAILING_STEP = 3


def main(mode: str, folder: str = "") -> None:
    world = MPI.COMM_WORLD
    world.Barrier()     # start together: under load, the ranks' imports end seconds apart
    failing = world.Get_rank() == world.Get_size() - 1
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    step = 0

    def fail() -> None:
        print(f"failing at {time.time()}", flush=True)
        raise RuntimeError(f"deliberate failure in the {mode} loop")

    def hook(state, bucket):
        if failing and step == FAILING_STEP:
            fail()
        return default_hooks.allreduce_hook(state, bucket)

    if mode == "zero":
        net = model
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                            lr=0.1)
    else:
        net = DistributedDataParallel(model)
        if mode == "hook":
            net.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(100):
        if failing and step == FAILING_STEP and mode in ("zero", "ddp"):
            fail()
        if mode == "save" and step == FAILING_STEP:
            if world.Get_rank() == 0:
                print(f"failing at {time.time()}", flush=True)
                checkpoint.save(os.path.join(folder, "step-3.h5"), net, optimizer)
            world.Barrier()
        net(torch.randn(16, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    print("not reached", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
