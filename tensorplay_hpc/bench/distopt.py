"""DistributedOptimizer over MPI windows against PyTorch's over torch.distributed.rpc.

``mpiexec -n 2 python -m tensorplay_hpc.bench distopt``: the last rank owns eight 1024x1024
float32 parameters and takes no part; rank 0 fetches them, runs a chain of matmuls on a batch
forward and backward, and steps SGD through the distributed optimizer; then the same with
PyTorch's over RPC. Any other ranks idle (at 4 ranks over two nodes of two, trainer and owner
are on different nodes). Rows name the transport of remote tensors (``transport``; set it with
``TENSORPLAY_HPC_RMA_TRANSPORT``).
Each is timed in turn with the same computation on local parameters (``compute_only_ms``, the
floor for both; ``compute_only_with_rpc_ms`` while RPC runs), which shows the machine's load;
``*_overhead_ms`` is what distribution adds to the computation. Then the reference operations
(``to_here``'s Get, the Put of a fetching step, the gradient Accumulate of ``backward``) against
the same operation on a raw mpi4py window of the same bytes, or, where MPI has no one-sided
windows between the two ranks, against the same bytes in raw mpi4py messages answered by the
owner's main thread (``mpi4py-raw-p2p``: a request and the data, or the data and an ack).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Sequence

import numpy as np
import torch

from tensorplay_hpc.bench.gloo import set_rendezvous
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.comm import capabilities
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer

__all__ = ["BATCHES", "RawWindow", "WARMUP", "WORLD", "alternating_medians", "bandwidths",
           "forward", "initial_parameter", "iterations", "local_iteration", "on_trainer",
           "our_iteration", "remote_parameter", "rpc_iteration", "run", "start_rpc"]

PARAMETERS, WIDTH, LR = 8, 1024, 1e-3
BATCHES = (1, 16)
WARMUP = 2
WORLD = MPI.COMM_WORLD
TRAINER, OWNER = 0, WORLD.Get_size() - 1


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


def on_trainer(measure: Callable[[], object]) -> object:
    """Run ``measure`` on the trainer while the owner idles outside MPI (sleeping, polling a
    nonblocking barrier); every rank gets its result. Collective."""
    result = measure() if WORLD.Get_rank() == TRAINER else None
    done = WORLD.Ibarrier()
    while not done.Test():
        time.sleep(1e-3)
    return WORLD.bcast(result, root=TRAINER)


def alternating_medians(calls: Sequence[Callable[[], object]], repeat: int,
                        warmup: int = WARMUP) -> List[float]:
    """Median seconds of each of ``calls``, timed in turn (ABAB...) so that the load of a shared
    machine weighs on all of them alike. Local."""
    for call in calls:
        for _ in range(warmup):
            call()
    times: List[List[float]] = [[] for _ in calls]
    for _ in range(repeat):
        for call, taken in zip(calls, times):
            start = time.perf_counter()
            call()
            taken.append(time.perf_counter() - start)
    return [statistics.median(taken) for taken in times]


def our_iteration(refs: List[rma.RemoteRef], optimizer: DistributedOptimizer,
                  batch: torch.Tensor) -> Callable[[], None]:
    def iteration() -> None:
        with autograd.context() as context_id:
            loss = forward([ref.to_here() for ref in refs], batch)
            autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    return iteration


def start_rpc() -> None:
    """``torch.distributed.rpc`` with TensorPipe on both ranks. Collective."""
    import torch.distributed.rpc as rpc
    set_rendezvous(WORLD)
    rank = WORLD.Get_rank()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD.Get_size(), backend=rpc.BackendType.TENSORPIPE,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions())


def rpc_iteration(rrefs: list, optimizer: object, batch: torch.Tensor) -> Callable[[], None]:
    """PyTorch's DistributedOptimizer on the same model."""
    import torch.distributed.autograd as dist_autograd

    def iteration() -> None:
        with dist_autograd.context() as context_id:
            loss = forward([rref.to_here() for rref in rrefs], batch)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    return iteration


def local_iteration(batch: torch.Tensor) -> Callable[[], None]:
    """The same iteration with local parameters: the computation alone, a floor for both."""
    weights = [initial_parameter(i).requires_grad_() for i in range(PARAMETERS)]
    optimizer = torch.optim.SGD(weights, lr=LR)

    def iteration() -> None:
        optimizer.zero_grad()
        forward(weights, batch).backward()
        optimizer.step()
    return iteration


def iterations(report: Report) -> None:
    """Training iterations: ours, then PyTorch's over RPC, each timed in turn with the local
    computation. Ours runs before RPC starts, since TensorPipe's threads keep polling for
    messages and slow every other process on a machine with few cores."""
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer
    owned = ([initial_parameter(i).requires_grad_() for i in range(PARAMETERS)]
             if WORLD.Get_rank() == OWNER else [])
    batches = [torch.randn(b, WIDTH, generator=torch.Generator().manual_seed(b)) for b in BATCHES]
    with rma.share(owned) as shared:
        transport = shared.transport
        refs = shared.refs_of(OWNER)
        with DistributedOptimizer(torch.optim.SGD, refs, lr=LR) as optimizer:
            ours = on_trainer(lambda: [alternating_medians(
                [our_iteration(refs, optimizer, batch), local_iteration(batch)], report.repeat)
                for batch in batches])
    try:
        start_rpc()
    except Exception as error:  # reported; the rest still runs
        if WORLD.Get_rank() == 0:
            print(f"torch.distributed.rpc could not run here: {type(error).__name__}: {error}; "
                  f"ours: {[round(o[0] * 1e3, 1) for o in ours]} ms an iteration", flush=True)
        return
    try:
        def measure() -> List[List[float]]:
            rrefs = [rpc.remote(f"worker{OWNER}", remote_parameter, args=(i,))
                     for i in range(PARAMETERS)]
            theirs = TorchDistributedOptimizer(torch.optim.SGD, rrefs, lr=LR)
            return [alternating_medians([rpc_iteration(rrefs, theirs, batch),
                                         local_iteration(batch)], report.repeat)
                    for batch in batches]
        theirs = on_trainer(measure)
    finally:
        rpc.shutdown()
    for size, (ours_s, local_s), (rpc_s, local_with_rpc_s) in zip(BATCHES, ours, theirs):
        report.add("distopt", f"SGD iteration, {PARAMETERS}x{WIDTH}x{WIDTH} on rank {OWNER}, "
                   f"batch {size}", ours_s, "torch-rpc", rpc_s,
                   nbytes=PARAMETERS * WIDTH * WIDTH * 4, transport=transport,
                   compute_only_ms=local_s * 1e3,
                   compute_only_with_rpc_ms=local_with_rpc_s * 1e3,
                   ours_overhead_ms=(ours_s - local_s) * 1e3,
                   rpc_overhead_ms=(rpc_s - local_with_rpc_s) * 1e3)


class RawWindow:
    """The baseline of one reference operation: a raw mpi4py window of ``elements`` float32 on
    the owner where MPI has one-sided windows between trainer and owner, raw messages otherwise.
    Collective to make and to free."""

    def __init__(self, elements: int) -> None:
        group = WORLD.Get_group().Incl([TRAINER, OWNER])
        self.pair = pair = WORLD.Create(group)
        group.Free()
        self.array = np.ones(elements, dtype=np.float32)
        self.owner, self.window = 1, None
        if pair != MPI.COMM_NULL:
            nbytes = self.array.nbytes if pair.Get_rank() == self.owner else 0
            if capabilities.within_one_node(pair):
                self.window = MPI.Win.Allocate_shared(nbytes, disp_unit=4, comm=pair)
            elif capabilities.one_sided_works(pair):
                self.window = MPI.Win.Allocate(nbytes, disp_unit=4, comm=pair)
        self.baseline = WORLD.bcast("mpi4py-raw" if self.window is not None
                                    else "mpi4py-raw-p2p", root=TRAINER)

    def call(self, operation: str) -> Callable[[], None]:
        """The trainer's side of one ``operation`` (get, put or accumulate)."""
        if self.window is not None:
            lock = MPI.LOCK_EXCLUSIVE if operation == "put" else MPI.LOCK_SHARED

            def one_sided() -> None:
                self.window.Lock(self.owner, lock)
                if operation == "accumulate":
                    self.window.Accumulate(self.array, self.owner, op=MPI.SUM)
                else:
                    getattr(self.window, operation.capitalize())(self.array, self.owner)
                self.window.Unlock(self.owner)
            return one_sided
        token = np.zeros(1, dtype=np.int64)

        def messages() -> None:
            if operation == "get":
                self.pair.Send(token, self.owner)
                self.pair.Recv(self.array, self.owner)
            else:
                self.pair.Send(self.array, self.owner)
                self.pair.Recv(token, self.owner)
        return messages

    def answer(self, operation: str, calls: int) -> None:
        """The owner's side of ``calls`` raw-message operations (nothing for a window)."""
        if self.window is not None or self.pair == MPI.COMM_NULL:
            return
        token, received = np.zeros(1, dtype=np.int64), np.empty_like(self.array)
        for _ in range(calls):
            if operation == "get":
                self.pair.Recv(token, 0)
                self.pair.Send(self.array, 0)
            else:
                self.pair.Recv(received, 0)
                if operation == "accumulate":
                    self.array += received
                self.pair.Send(token, 0)

    def free(self) -> None:
        if self.window is not None:
            self.window.Free()
        if self.pair != MPI.COMM_NULL:
            self.pair.Free()


def bandwidths(report: Report) -> None:
    """Get, Put and Accumulate of one parameter through our reference operations and through a
    raw mpi4py window (or raw messages), trainer to owner."""
    rank = WORLD.Get_rank()
    for elements in (16 * 1024, WIDTH * WIDTH):
        nbytes = elements * 4
        mine = [torch.ones(elements)] if rank == OWNER else []
        raw = RawWindow(elements)
        with rma.share(mine) as shared:
            [ref] = shared.refs
            local = torch.ones(elements)

            def put() -> None:
                with shared.values.locked(OWNER, exclusive=True):
                    shared.values.put(local, OWNER, shared.value_offset(ref))

            def accumulate() -> None:
                shared.accumulate_gradients({ref: local}, [])

            cases = [("get (RemoteRef.to_here)", ref.to_here, "get"),
                     ("put (Window.put: a fetching step's write)", put, "put"),
                     ("accumulate (gradient of backward)", accumulate, "accumulate")]
            repeat = report.repeat * 3
            for case, ours_call, operation in cases:
                if rank == OWNER:
                    raw.answer(operation, WARMUP + repeat)
                ours_s, raw_s = on_trainer(lambda: alternating_medians(
                    [ours_call, raw.call(operation)], repeat))
                report.add("distopt", case, ours_s, raw.baseline, raw_s, nbytes=nbytes,
                           transport=shared.transport, ours_GBps=nbytes / ours_s / 1e9,
                           raw_GBps=nbytes / raw_s / 1e9)
            WORLD.Barrier()
        raw.free()


def run(report: Report) -> None:
    """Collective on two ranks or more."""
    if WORLD.Get_size() < 2:
        raise SystemExit("the distopt benchmark needs 2 ranks or more: mpiexec -n 2 ...")
    iterations(report)
    bandwidths(report)
