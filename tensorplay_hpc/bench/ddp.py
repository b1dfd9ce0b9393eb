"""DistributedDataParallel on the benchmark MLP (16.8M parameters), batch 32: one training step
without the optimizer (zero_grad, forward, backward with the gradient averaging) against
PyTorch's DistributedDataParallel over gloo, and against the limit without overlap (a plain
forward and backward, then one raw mpi4py ``Allreduce`` of all the gradients' bytes in one
numpy array)."""
from __future__ import annotations

import copy

import numpy as np
import torch
from mpi4py import MPI

from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

BATCH = 32


def _step(model: torch.nn.Module, x: torch.Tensor):
    def step() -> None:
        model.zero_grad()
        model(x).square().mean().backward()
    return step


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    module = mlp()
    width = module[0].in_features
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(world.Get_rank()))
    numel = sum(p.numel() for p in module.parameters())
    flat = np.zeros(numel, dtype=np.float32)
    local = _step(copy.deepcopy(module), x)

    def raw() -> None:
        local()
        world.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT])

    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    for bucket_view in (False, True):
        ours = DistributedDataParallel(copy.deepcopy(module), gradient_as_bucket_view=bucket_view)
        ours_s, theirs_s, raw_s, local_s = compare(
            [_step(ours, x), _step(theirs, x), raw, local], report.repeat)
        case = f"fwd+bwd batch {BATCH}, bucket view {'on' if bucket_view else 'off'}"
        extra = {"local_fwd_bwd_ms": round(local_s * 1e3, 1), "buckets": len(ours.buckets)}
        report.add("ddp", case, ours_s, "torch-gloo", theirs_s, nbytes=4 * numel, **extra)
        report.add("ddp", case, ours_s, "mpi4py-raw", raw_s, nbytes=4 * numel, **extra)
        del ours
