"""A user's mistake, for the watchdog tests: one of the library's entry points called on one rank
only (rank 0; for ``ddp_forward`` the last rank, since the root of a broadcast may finish alone),
while the other ranks go on to a barrier of their own (``MPI.COMM_WORLD.Barrier()``).

    one_rank_call_job.py CASE FOLDER

Every rank first builds what a training job has (a model, DistributedDataParallel over it, a
ZeroRedundancyOptimizer) and what CASE needs, together; then the calling rank prints the time
(``time.time()``) at which it calls the entry point. A collective entry point must end the job
through the watchdog (``TENSORPLAY_HPC_COLLECTIVE_TIMEOUT``); one that is not collective returns,
the rank prints ``returned``, and the job ends normally. FOLDER is a folder every rank sees.
"""
import faulthandler
import os
import sys
import time
from typing import Callable, Dict, Tuple

faulthandler.dump_traceback_later(90)   # a job that hangs says where, before it is killed at 120 s

import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint, comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import DistributedOptimizer, ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

COLLECTIVE = ("zero_step", "zero_consolidate", "zero_add_param_group", "zero_load_state_dict",
              "ddp_forward", "ddp_backward", "averager", "rma_share", "checkpoint_save",
              "checkpoint_save_async", "checkpoint_load", "trace_write", "coalesced_wait")
"""The entry points that every rank must call."""
LOCAL = ("distributed_optimizer_step", "checkpoint_latest")
"""Those that one rank may call alone."""


def caller(case: str, size: int) -> int:
    """The rank that calls ``case``'s entry point alone."""
    return size - 1 if case == "ddp_forward" else 0


def _prepare(case: str, folder: str) -> Tuple[Callable[[], object], list]:
    """Build, on every rank, what ``case`` needs; return rank 0's call, and the objects to keep
    open meanwhile (as a training job keeps them)."""
    world = MPI.COMM_WORLD
    world.Barrier()     # start together: under load, the ranks' imports end seconds apart
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2))  # buffers:
    # DistributedDataParallel's forward pass broadcasts them
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    x = torch.ones(3, 4)
    path = os.path.join(folder, "step-1.h5")
    group = comm.ProcessGroup(owner="one_rank_call_job")
    calls: Dict[str, Callable[[], object]] = {
        "zero_step": zero.step,
        "zero_consolidate": zero.consolidate_state_dict,
        "zero_add_param_group": lambda: zero.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(3))]}),
        "zero_load_state_dict": lambda: zero.load_state_dict(
            torch.optim.SGD(model.parameters(), lr=0.2).state_dict()),
        "ddp_forward": lambda: ddp(x),
        "averager": lambda: averagers.PeriodicModelAverager(period=1).average_parameters(
            model.parameters()),
        "rma_share": lambda: rma.share([torch.zeros(2)]),
        "checkpoint_save": lambda: checkpoint.save(path, model=model),
        "checkpoint_save_async": lambda: checkpoint.save_async(path, model=model).wait(),
        "checkpoint_load": lambda: checkpoint.load(path, model=model),
        "checkpoint_latest": lambda: checkpoint.latest(folder),
        "trace_write": trace.write,
        "coalesced_wait": lambda: comm.all_reduce_coalesced(
            [torch.ones(3), torch.ones(2, dtype=torch.float64)], group.comm,
            async_op=True).wait(),
    }
    if case in ("zero_step", "averager"):
        ddp(x).sum().backward()          # every rank: the gradients to step or average with
    if case == "ddp_backward":
        loss = ddp(x).sum()              # every rank: forward; rank 0 alone goes backward
        calls[case] = loss.backward
    if case in ("checkpoint_load", "checkpoint_latest"):
        checkpoint.save(path, model=model)
    if case == "trace_write":
        trace.enable(os.path.join(folder, "trace"))
    if case == "distributed_optimizer_step":
        shared = rma.share([torch.ones(2, requires_grad=True)])
        optimizer = DistributedOptimizer(torch.optim.SGD, shared.refs_of(0), lr=0.1)

        def step() -> None:
            with autograd.context() as context_id:
                autograd.backward(context_id, [shared.refs_of(0)[0].to_here().sum()])
                optimizer.step(context_id)
        calls[case] = step
    world.Barrier()
    return calls[case], [ddp, zero, group]


def main(case: str, folder: str) -> None:
    world = MPI.COMM_WORLD
    call, _ = _prepare(case, folder)
    if world.Get_rank() == caller(case, world.Get_size()):
        print(f"calling at {time.time()}", flush=True)
        call()
        print("returned", flush=True)
    world.Barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
