"""The ``mpi4py`` torch.distributed backend: collectives called through torch.distributed on a
group of the backend against a raw mpi4py call on the same bytes (the limit), against the same
call on a group that answers with that raw call and nothing else (the floor of any backend
written in Python: PyTorch's own path into it) and against the same call on gloo; then PyTorch's
own DistributedDataParallel and an FSDP2 (``fully_shard``, ZeRO-3) training step with Adam on
the benchmark MLP, over the backend against over gloo. Each row gives the medians of
interleaved rounds and the spread of each side's rounds."""
from __future__ import annotations

from statistics import median
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as _C10dProcessGroup

from tensorplay_hpc.bench.comm import SIZES, bus_factor
from tensorplay_hpc.bench.gloo import backend_group
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import interleaved, spread
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.staging import memory
from tensorplay_hpc.distributed.backend.work import BackendWork

__all__ = ["BATCH", "fully_sharded", "run"]

BATCH = 32

Case = Tuple[str, Callable[[dist.ProcessGroup], Callable[[], object]], Callable[[], object]]


class _PythonFloor(_C10dProcessGroup):
    """A process group that answers each collective with the raw mpi4py call on the tensors'
    own memory (float32, as the benchmark's tensors are) and a completed handle: no checks, no
    watchdog, no trace. Timing torch.distributed on it measures what PyTorch's path into a
    backend written in Python costs by itself."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm

    def _done(self) -> BackendWork:
        return BackendWork(None, [])

    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> BackendWork:
        self._comm.Allreduce(MPI.IN_PLACE, [memory(tensors[0]), MPI.FLOAT])
        return self._done()

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: object) -> BackendWork:
        self._comm.Allgather([memory(input), MPI.FLOAT], [memory(output), MPI.FLOAT])
        return self._done()

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: object) -> BackendWork:
        self._comm.Reduce_scatter([memory(input), MPI.FLOAT], [memory(output), MPI.FLOAT],
                                  [output.numel()] * self.size())
        return self._done()

    def broadcast(self, tensors: List[torch.Tensor], opts: object) -> BackendWork:
        self._comm.Bcast([memory(tensors[0]), MPI.FLOAT], opts.rootRank)
        return self._done()


def _collectives(nbytes: int, raw: MPI.Intracomm, size: int) -> List[Case]:
    """(name, call on a torch.distributed group, raw mpi4py call) per collective. Both move
    the same bytes in the same memory: the raw calls take numpy views of the tensors, so the
    ratio is the software's cost alone, not where the allocator placed two sets of buffers."""
    n = nbytes // 4
    part = n // size
    t, mine, whole = torch.ones(n), torch.ones(part), torch.empty(part * size)
    a, a_mine, a_whole = t.numpy(), mine.numpy(), whole.numpy()
    counts = [part] * size
    return [
        ("allreduce", lambda g: lambda: dist.all_reduce(t, group=g),
         lambda: raw.Allreduce(MPI.IN_PLACE, a)),
        ("allgather", lambda g: lambda: dist.all_gather_single(whole, mine, group=g),
         lambda: raw.Allgather(a_mine, a_whole)),
        ("reduce_scatter", lambda g: lambda: dist.reduce_scatter_single(mine, whole, group=g),
         lambda: raw.Reduce_scatter(a_whole, a_mine, counts)),
        ("broadcast", lambda g: lambda: dist.broadcast(t, group=g, group_src=0),
         lambda: raw.Bcast(a, 0)),
    ]


def fully_sharded(group: dist.ProcessGroup, module: Optional[torch.nn.Module] = None,
                  rows: Optional[Sequence[Sequence[int]]] = None) -> torch.nn.Module:
    """``module`` (default: the benchmark MLP) under FSDP2, each Linear a unit, on a mesh of
    ``group``'s backend: 1-D over all ranks (ZeRO-3), or 2-D (HSDP) with ``rows`` the ranks
    holding the shards of one replica each (as :func:`~tensorplay_hpc.train.mesh.hybrid_shape`
    gives them). Collective over the default group (the 2-D mesh makes groups)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    if rows is None:
        mesh = DeviceMesh.from_group(group, "cpu")
    else:
        backend = dist.get_backend(group)
        layout = torch.tensor(rows)
        shards = [dist.new_group(row.tolist(), backend=backend) for row in layout]
        copies = [dist.new_group(col.tolist(), backend=backend) for col in layout.t()]
        row, col = divmod(int((layout.flatten() == dist.get_rank()).nonzero()), layout.shape[1])
        mesh = DeviceMesh.from_group([copies[col], shards[row]], "cpu", mesh=layout,
                                     mesh_dim_names=(f"{backend} replicas", f"{backend} shards"))
    model = mlp() if module is None else module
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _training_step(model: torch.nn.Module, x: torch.Tensor,
                   optimizer: torch.optim.Optimizer = None) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad()
        model(x).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
    return step


def _add(report: Report, case: str, ours_s: List[float], baseline: str, base_s: List[float],
         **extra: object) -> None:
    """Report the medians of two lists of samples (seconds per call), with the spread of
    each."""
    report.add("backend", case, median(ours_s), baseline, median(base_s),
               ours_spread=spread(ours_s), base_spread=spread(base_s), **extra)


def run(report: Report) -> None:
    ours = backend_group()
    gloo = dist.group.WORLD
    raw = MPI.COMM_WORLD.Dup()
    floor = _PythonFloor(raw)
    size = raw.Get_size()
    for nbytes in SIZES:
        for case, call, limit in _collectives(nbytes, raw, size):
            ours_s, *baselines = interleaved([call(ours), limit, call(floor), call(gloo)],
                                             report.repeat)
            busbw = bus_factor(case, size) * nbytes / median(ours_s) / 1e9
            for baseline, base_s in zip(("mpi4py-raw", "python-backend-floor", "torch-gloo"),
                                        baselines):
                _add(report, case, ours_s, baseline, base_s, nbytes=nbytes,
                     busbw_GBps=round(busbw, 3))

    x = torch.randn(BATCH, 1024, generator=torch.Generator().manual_seed(raw.Get_rank()))
    steps = []
    for group in (ours, gloo):
        ddp = torch.nn.parallel.DistributedDataParallel(mlp(), process_group=group)
        steps.append(_training_step(ddp, x))
    ours_s, gloo_s = interleaved(steps, report.repeat)
    _add(report, "torch DDP step (mlp, no optimizer)", ours_s, "torch-gloo", gloo_s)

    steps = []
    for group in (ours, gloo):
        model = fully_sharded(group)
        steps.append(_training_step(model, x, torch.optim.Adam(model.parameters(), lr=1e-3)))
    ours_s, gloo_s = interleaved(steps, report.repeat)
    _add(report, "FSDP2 step (mlp, zero-3, adam)", ours_s, "torch-gloo", gloo_s)
    raw.Free()
    dist.destroy_process_group(ours)
