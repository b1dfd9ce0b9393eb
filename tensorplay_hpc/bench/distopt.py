"""DistributedOptimizer over MPI windows against PyTorch's over torch.distributed.rpc.

``mpiexec -n 2 python -m tensorplay_hpc.bench distopt``: rank 1 owns eight 1024x1024 float32
parameters and takes no part; rank 0 fetches them, runs a chain of matmuls on a batch forward and
backward, and steps SGD through the distributed optimizer. Then the reference operations
(``to_here``'s Get, the parameter Put of a step, the gradient Accumulate of ``backward``) against
the same operation on a raw mpi4py window of the same bytes.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, List

import numpy as np
import torch
from mpi4py import MPI

from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import median_seconds
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer

PARAMETERS, WIDTH, BATCH, LR = 8, 1024, 32, 1e-3
TRAINER, OWNER = 0, 1
WORLD = MPI.COMM_WORLD


def initial_parameter(index: int) -> torch.Tensor:
    """Parameter ``index``, the same in both implementations."""
    generator = torch.Generator().manual_seed(index)
    return torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH ** 0.5


def remote_parameter(index: int) -> torch.Tensor:
    """Made on the owner by PyTorch's RPC."""
    return initial_parameter(index).requires_grad_()


def forward(weights: List[torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    x = batch
    for w in weights:
        x = torch.tanh(x @ w)
    return x.square().mean()


def trainer_time(iteration: Callable[[], object], repeat: int) -> float:
    """Median time of ``iteration`` on the trainer while the owner idles outside MPI
    (sleeping, polling a nonblocking barrier). Collective; every rank gets the trainer's time."""
    seconds = 0.0
    if WORLD.Get_rank() == TRAINER:
        seconds = median_seconds(iteration, repeat=repeat, comm=MPI.COMM_SELF)
    done = WORLD.Ibarrier()
    while not done.Test():
        time.sleep(1e-3)
    return WORLD.bcast(seconds, root=TRAINER)


def ours(batch: torch.Tensor, repeat: int) -> float:
    owned = [initial_parameter(i) for i in range(PARAMETERS)] if WORLD.Get_rank() == OWNER else []
    with rma.share(owned) as shared:
        refs = shared.refs_of(OWNER)
        with DistributedOptimizer(torch.optim.SGD, refs, lr=LR) as optimizer:
            def iteration() -> None:
                with autograd.context() as context_id:
                    loss = forward([ref.to_here() for ref in refs], batch)
                    autograd.backward(context_id, [loss])
                    optimizer.step(context_id)
            return trainer_time(iteration, repeat)


def free_port() -> int:
    """A free local port chosen on rank 0. Collective."""
    port = None
    if WORLD.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return WORLD.bcast(port, root=0)


def torch_rpc(batch: torch.Tensor, repeat: int) -> float:
    """PyTorch's DistributedOptimizer over TensorPipe RPC. Collective; raises if RPC fails."""
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    rank = WORLD.Get_rank()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType.TENSORPIPE,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions())
    try:
        iteration = None
        if rank == TRAINER:
            rrefs = [rpc.remote(f"worker{OWNER}", remote_parameter, args=(i,))
                     for i in range(PARAMETERS)]
            optimizer = TorchDistributedOptimizer(torch.optim.SGD, rrefs, lr=LR)

            def iteration() -> None:
                with dist_autograd.context() as context_id:
                    loss = forward([rref.to_here() for rref in rrefs], batch)
                    dist_autograd.backward(context_id, [loss])
                    optimizer.step(context_id)
        return trainer_time(iteration, repeat)
    finally:
        rpc.shutdown()


def bandwidths(report: Report) -> None:
    """Get, Put and Accumulate of one parameter through our reference operations and through a
    raw mpi4py window, trainer to owner."""
    rank = WORLD.Get_rank()
    for elements in (16 * 1024, WIDTH * WIDTH):
        nbytes = elements * 4
        mine = [torch.ones(elements)] if rank == OWNER else []
        raw_window = MPI.Win.Allocate(nbytes if rank == OWNER else 0, disp_unit=4, comm=WORLD)
        array = np.ones(elements, dtype=np.float32)
        with rma.share(mine) as shared:
            [ref] = shared.refs
            local = torch.ones(elements)

            def put() -> None:
                with shared.values.locked(OWNER, exclusive=True):
                    shared.values.put(local, OWNER, shared.value_offset(ref))

            def accumulate() -> None:
                shared.accumulate_gradients({ref: local}, [])

            def raw(operation: str, lock: int) -> Callable[[], None]:
                def call() -> None:
                    raw_window.Lock(OWNER, lock)
                    if operation == "accumulate":
                        raw_window.Accumulate(array, OWNER, op=MPI.SUM)
                    else:
                        getattr(raw_window, operation.capitalize())(array, OWNER)
                    raw_window.Unlock(OWNER)
                return call

            cases = [("get (RemoteRef.to_here)", ref.to_here, "get", MPI.LOCK_SHARED),
                     ("put (parameter write of a step)", put, "put", MPI.LOCK_EXCLUSIVE),
                     ("accumulate (gradient of backward)", accumulate, "accumulate",
                      MPI.LOCK_SHARED)]
            for case, ours_call, operation, lock in cases:
                ours_s = trainer_time(ours_call, report.repeat * 3)
                raw_s = trainer_time(raw(operation, lock), report.repeat * 3)
                report.add("distopt", case, ours_s, "mpi4py-raw", raw_s, nbytes=nbytes,
                           ours_GBps=nbytes / ours_s / 1e9, raw_GBps=nbytes / raw_s / 1e9)
        raw_window.Free()


def run(report: Report) -> None:
    """Collective on exactly two ranks."""
    if WORLD.Get_size() != 2:
        raise SystemExit("the distopt benchmark runs on 2 ranks: mpiexec -n 2 ...")
    batch = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(7))
    nbytes = PARAMETERS * WIDTH * WIDTH * 4
    case = f"SGD iteration, {PARAMETERS}x{WIDTH}x{WIDTH} on rank {OWNER}, batch {BATCH}"
    ours_s = ours(batch, report.repeat)
    try:
        rpc_s = torch_rpc(batch, report.repeat)
    except Exception as error:  # reported, and the rest still runs
        if WORLD.Get_rank() == 0:
            print(f"torch.distributed.rpc could not run here: {type(error).__name__}: {error}",
                  flush=True)
            print(f"ours: {ours_s * 1e3:.1f} ms an iteration", flush=True)
    else:
        report.add("distopt", case, ours_s, "torch-rpc", rpc_s, nbytes=nbytes)
    bandwidths(report)
