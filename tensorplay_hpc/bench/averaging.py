"""Model averaging of the benchmark MLP (16.8M parameters): ``average_parameters`` and a
``PeriodicModelAverager`` (period 1, so every call averages) against PyTorch's
``PeriodicModelAverager`` over gloo, and against a raw mpi4py ``Allreduce`` of the same bytes in
one numpy array."""
from __future__ import annotations

import warnings

import numpy as np
import torch
from mpi4py import MPI
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers

from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.algorithms.model_averaging.utils import average_parameters


def _params():
    params = list(mlp().parameters())
    for p in params:
        p.grad = torch.zeros_like(p)   # only parameters with gradients are averaged
    return params


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    ours_params, theirs_params = _params(), _params()
    numel = sum(p.numel() for p in ours_params)
    flat = np.ones(numel, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # period 1 warns in both libraries
        ours_averager = averagers.PeriodicModelAverager(period=1)
        theirs_averager = torch_averagers.PeriodicModelAverager(period=1)

    def raw() -> None:
        world.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT])

    function_s, averager_s, theirs_s, raw_s = compare([
        lambda: average_parameters(ours_params, None),
        lambda: ours_averager.average_parameters(ours_params),
        lambda: theirs_averager.average_parameters(theirs_params),
        raw], report.repeat)
    nbytes = 4 * numel
    report.add("averaging", "average_parameters", function_s, "mpi4py-raw", raw_s, nbytes=nbytes)
    report.add("averaging", "PeriodicModelAverager", averager_s, "torch-gloo", theirs_s,
               nbytes=nbytes)
    report.add("averaging", "PeriodicModelAverager", averager_s, "mpi4py-raw", raw_s,
               nbytes=nbytes)
