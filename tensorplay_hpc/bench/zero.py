"""ZeroRedundancyOptimizer with Adam on the benchmark MLP: step time with and without bucket view
against PyTorch's ZeroRedundancyOptimizer over gloo and against the limit (this rank's Adam step
over its shard plus a raw mpi4py ``Allgatherv`` of all the parameters' bytes in one numpy array);
and ``consolidate_state_dict`` against PyTorch's; the step over 50,000 tiny parameters, where
per-parameter work dominates. Gradients are set once, before timing; only ``step()`` is
timed."""
from __future__ import annotations

from typing import List

import numpy as np
import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import TINY_COUNT, mlp, tiny_parameters
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ADAM_KERNELS", "CONSOLIDATE_REPEAT", "run"]

# Adam's multi-tensor (foreach) and fused CPU kernels, the same for every contender: the first
# makes the step compute-bound, the second leaves mostly the parameter sync.
ADAM_KERNELS = ("foreach", "fused")
CONSOLIDATE_REPEAT = 3   # PyTorch takes seconds per consolidation


def _params_with_grads(model: torch.nn.Module) -> List[torch.Tensor]:
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    return params


def _limit(zero: ZeroRedundancyOptimizer, world: MPI.Intracomm, adam: dict):
    """This rank's Adam step over its own parameters, then one raw in-place Allgatherv of every
    parameter's bytes, with the same per-rank counts. The array is filled (np.ones), since
    untouched zero pages would be read unrealistically fast."""
    owned = [zero.params_by_index[i] for g in zero.partition.owned(world.rank) for i in g]
    shard = [p.detach().clone() for p in owned]
    for clone, param in zip(shard, owned):
        clone.grad = param.grad.clone()
    optimizer = torch.optim.Adam(shard, **adam)
    counts = zero.partition.loads
    displs = np.cumsum([0] + counts[:-1]).tolist()
    flat = np.ones(sum(counts), dtype=np.float32)

    def allgather() -> None:
        world.Allgatherv(MPI.IN_PLACE, [flat, (counts, displs), MPI.FLOAT])

    def step() -> None:
        optimizer.step()
        allgather()
    return step, allgather


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    for kernel in ADAM_KERNELS:
        adam = {"lr": 1e-3, kernel: True}
        for bucket_view in (True, False):
            ours = ZeroRedundancyOptimizer(_params_with_grads(mlp()), torch.optim.Adam,
                                           parameters_as_bucket_view=bucket_view, **adam)
            theirs = TorchZeRO(_params_with_grads(mlp()), torch.optim.Adam,
                               parameters_as_bucket_view=bucket_view, **adam)
            limit, raw_allgather = _limit(ours, world, adam)
            nbytes = 4 * sum(p.numel() for p in ours.params_by_index)
            ours_s, theirs_s, limit_s, raw_s = compare(
                [ours.step, theirs.step, limit, raw_allgather], report.repeat)
            case = f"{kernel} adam step, bucket view {'on' if bucket_view else 'off'}"
            report.add("zero", case, ours_s, "torch-gloo", theirs_s, nbytes=nbytes)
            report.add("zero", case, ours_s, "limit", limit_s, nbytes=nbytes,
                       raw_allgatherv_ms=round(raw_s * 1e3, 2))
            if kernel == ADAM_KERNELS[0] and bucket_view:
                ours_s, theirs_s = compare(
                    [ours.consolidate_state_dict, theirs.consolidate_state_dict],
                    CONSOLIDATE_REPEAT, warmup=1)
                report.add("zero", "consolidate_state_dict (adam)", ours_s, "torch-gloo",
                           theirs_s, nbytes=2 * nbytes)
            ours.close()
    _tiny_parameters(report)


def _tiny_parameters(report: Report) -> None:
    adam = {"lr": 1e-3, "foreach": True}
    ours = ZeroRedundancyOptimizer(_params_with_grads(tiny_parameters()), torch.optim.Adam, **adam)
    theirs = TorchZeRO(_params_with_grads(tiny_parameters()), torch.optim.Adam, **adam)
    ours_s, theirs_s = compare([ours.step, theirs.step], report.repeat)
    report.add("zero", f"foreach adam step, {TINY_COUNT:,} tiny parameters", ours_s,
               "torch-gloo", theirs_s, nbytes=4 * sum(p.numel() for p in ours.params_by_index))
    ours.close()
