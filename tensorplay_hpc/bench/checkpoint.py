"""Checkpoints of ZeRO-Adam over the benchmark MLP: our parallel HDF5 save and load against
PyTorch's path (ZeroRedundancyOptimizer.consolidate_state_dict on rank 0, then torch.save; on
load, torch.load and load_state_dict on every rank), and our write bandwidth against a raw h5py
``mpio`` write of the same bytes (each rank writes its share of one dataset)."""
from __future__ import annotations

import os
import shutil
import tempfile

import h5py
import numpy as np
import torch
from mpi4py import MPI
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

from tensorplay_hpc import checkpoint
from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import mlp
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

REPEAT = 3   # PyTorch's consolidation takes seconds


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step, so that Adam's state exists."""
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


def _raw_write(path: str, nbytes: int, world: MPI.Intracomm):
    """The limit: one float32 dataset of ``nbytes``, each rank writing its contiguous share."""
    n = nbytes // 4
    share = n // world.size
    start = world.rank * share
    stop = n if world.rank == world.size - 1 else start + share
    data = np.ones(stop - start, dtype=np.float32)

    def write() -> None:
        with h5py.File(path, "w", driver="mpio", comm=world) as f:
            f.create_dataset("data", shape=(n,), dtype=np.float32)[start:stop] = data
    return write


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    folder = world.bcast(tempfile.mkdtemp(prefix="tensorplay-bench-") if world.rank == 0 else None)
    try:
        model = mlp()
        ours = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        _stepped(model, ours)
        theirs_model = mlp()
        theirs = TorchZeRO(theirs_model.parameters(), torch.optim.Adam, lr=1e-3)
        _stepped(theirs_model, theirs)
        ours_path = os.path.join(folder, "ours.h5")
        torch_path = os.path.join(folder, "torch.pt")

        def torch_save() -> None:
            theirs.consolidate_state_dict(to=0)
            if world.rank == 0:
                torch.save({"model": theirs_model.state_dict(), "optimizer": theirs.state_dict()},
                           torch_path)
            world.Barrier()

        def torch_load() -> None:
            saved = torch.load(torch_path, weights_only=True)
            theirs_model.load_state_dict(saved["model"])
            theirs.load_state_dict(saved["optimizer"])

        save_s, torch_save_s = compare([lambda: checkpoint.save(ours_path, model, ours),
                                        torch_save], REPEAT, warmup=1)
        nbytes = os.path.getsize(ours_path)
        report.add("checkpoint", "save (zero adam)", save_s, "torch-save", torch_save_s,
                   nbytes=nbytes)
        load_s, torch_load_s = compare([lambda: checkpoint.load(ours_path, model, ours),
                                        torch_load], REPEAT, warmup=1)
        report.add("checkpoint", "load (zero adam)", load_s, "torch-save", torch_load_s,
                   nbytes=nbytes)
        (raw_s,) = compare([_raw_write(os.path.join(folder, "raw.h5"), nbytes, world)],
                           REPEAT, warmup=1)
        report.add("checkpoint", "save write bandwidth", save_s, "h5py-raw", raw_s, nbytes=nbytes,
                   ours_GBps=round(nbytes / save_s / 1e9, 3), raw_GBps=round(nbytes / raw_s / 1e9, 3))
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
