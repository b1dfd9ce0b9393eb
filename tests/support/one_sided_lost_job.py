"""A rank lost while others step a DistributedOptimizer on its parameters, with recovery on
(launched with ULFM, over simulated nodes so that the windows are not in shared memory) and MPI's
own windows asked for (the ``mpi`` transport; recovery would take served ones): the last rank
owns a linear layer; the others step it until the owner, after 1 s, dies with
SIGKILL. One-sided windows are not fault tolerant: the trainers' operations on the lost owner
would wait for ever, so the job must end. The owner prints ``transport T`` and ``leaving at
T`` (``time.time()``); a trainer that steps on prints ``2000 steps with no failure``."""
import os
import signal
import time

import torch

from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.capabilities import TRANSPORT_ENV
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer

fault_tolerance.enable()
os.environ[TRANSPORT_ENV] = "mpi"
world = MPI.COMM_WORLD
rank, owner = world.Get_rank(), world.Get_size() - 1
layer = torch.nn.Linear(64, 64) if rank == owner else None
shared = rma.share(layer.parameters() if layer else [])
optimizer = DistributedOptimizer(torch.optim.Adam, shared.refs, lr=1e-3)
world.Barrier()
if rank == owner:
    print(f"[{rank}] transport {shared.transport}", flush=True)
    time.sleep(1.0)
    print(f"[{rank}] leaving at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(2000):
    with autograd.context() as context_id:
        weights = [ref.to_here() for ref in shared.refs]
        loss = torch.nn.functional.linear(torch.ones(4, 64), *weights).square().mean()
        autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    time.sleep(0.005)
print(f"[{rank}] 2000 steps with no failure", flush=True)
os._exit(0)
