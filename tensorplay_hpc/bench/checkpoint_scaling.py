"""Checkpoints at the launch's size N: a ZeRO-Adam save and load on N ranks, and the reshards
N -> N/2 (a file saved on N ranks loaded on half of them) and N/2 -> N, against raw MPI-IO of
the file's bytes (``Write_at_all`` and ``fsync`` for the save, ``Read_at_all`` by the same
ranks for the loads). The model is modest (8 x Linear(512, 512), a 25 MiB file) so that 16
ranks on a small machine finish in a minute; ``bench checkpoint`` runs these cases too, and
``bench checkpoint-scaling`` runs them alone (for 8 and 16 ranks over simulated nodes)."""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from typing import Callable, Optional

import numpy as np
import torch
from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import interleaved, spread
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["WIDTH", "LAYERS", "measure", "raw_io", "run"]

WIDTH, LAYERS = 512, 8


def _zero(comm: MPI.Intracomm):
    """A model and its ZeRO-Adam over ``comm``, stepped once (so that Adam's state exists)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3,
                                        process_group=comm)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer


def _share(nbytes: int, comm: MPI.Intracomm) -> slice:
    """This rank's contiguous share of ``nbytes``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    each = nbytes // size
    return slice(rank * each, nbytes if rank == size - 1 else (rank + 1) * each)


def raw_io(path: str, nbytes: int, comm: MPI.Intracomm, write: bool) -> Callable[[], None]:
    """The limit: ``comm``'s ranks write (then ``fsync``, as a save does before its rename) or
    read ``nbytes`` of ``path``, each its contiguous share, in one ``Write_at_all`` /
    ``Read_at_all``."""
    share = _share(nbytes, comm)
    data = np.ones(share.stop - share.start, dtype=np.uint8)

    def run() -> None:
        if write:
            handle = MPI.File.Open(comm, path, MPI.MODE_WRONLY | MPI.MODE_CREATE)
            handle.Set_size(0)
            handle.Write_at_all(share.start, data)
            handle.Sync()
        else:
            handle = MPI.File.Open(comm, path, MPI.MODE_RDONLY)
            handle.Read_at_all(share.start, data)
        handle.Close()
    return run


def _on(comm: MPI.Comm, fn: Optional[Callable[[], object]]) -> Callable[[], None]:
    """``fn`` run by the ranks of ``comm`` only (``None`` elsewhere: the others wait in the
    timing's barrier)."""
    def run() -> None:
        if comm != MPI.COMM_NULL:
            fn()
    return run


def measure(report: Report, folder: str, world: MPI.Intracomm) -> None:
    """The save, load and reshard cases at ``world``'s size. Collective."""
    n = world.Get_size()
    half = world.Split(0 if world.Get_rank() < max(n // 2, 1) else MPI.UNDEFINED)
    model, optimizer = _zero(world)
    small_model, small = _zero(half) if half != MPI.COMM_NULL else (None, None)
    path = os.path.join(folder, "scale.h5")
    halved = os.path.join(folder, "scale-half.h5")
    checkpoint.save(path, model, optimizer, process_group=world)
    if half != MPI.COMM_NULL:
        checkpoint.save(halved, small_model, small, process_group=half)
    world.Barrier()
    nbytes = os.path.getsize(path)
    raw = os.path.join(folder, "scale-raw.bin")
    halved_bytes = world.bcast(os.path.getsize(halved) if world.Get_rank() == 0 else None)
    raw = os.path.join(folder, "scale-raw.bin")
    in_half = half != MPI.COMM_NULL
    cases = [
        (f"save, {n} ranks", lambda: checkpoint.save(path, model, optimizer, process_group=world),
         "mpiio-raw+fsync", raw_io(raw, nbytes, world, write=True), nbytes),
        (f"load, {n} ranks", lambda: checkpoint.load(path, model, optimizer, process_group=world),
         "mpiio-raw read", raw_io(path, nbytes, world, write=False), nbytes)]
    if n > 1:
        cases += [
            (f"reshard {n} -> {n // 2} ranks", _on(half, lambda: checkpoint.load(
                path, small_model, small, process_group=half)),
             "mpiio-raw read", _on(half, raw_io(path, nbytes, half, write=False) if in_half
                                   else None), nbytes),
            (f"reshard {n // 2} -> {n} ranks", lambda: checkpoint.load(
                halved, model, optimizer, process_group=world),
             "mpiio-raw read", raw_io(halved, halved_bytes, world, write=False), halved_bytes)]
    functions = [fn for case in cases for fn in (case[1], case[3])]
    samples = interleaved(functions, report.repeat, warmup=1, comm=world)
    for i, (case, _, baseline, _, size) in enumerate(cases):
        ours, theirs = samples[2 * i], samples[2 * i + 1]
        report.add("checkpoint", f"scale: {case} (zero adam)", statistics.median(ours), baseline,
                   statistics.median(theirs), nbytes=size, rounds=len(ours),
                   ours_spread=spread(ours), base_spread=spread(theirs))
    optimizer.close()
    if small is not None:
        small.close()
    if half != MPI.COMM_NULL:
        half.Free()


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    folder = world.bcast(tempfile.mkdtemp(prefix="tensorplay-bench-") if world.rank == 0 else None)
    try:
        measure(report, folder, world)
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
