"""Checkpoints of ZeRO-Adam over the benchmark MLP: our parallel HDF5 save and load against
PyTorch's path (ZeroRedundancyOptimizer.consolidate_state_dict on rank 0, then torch.save; on
load, torch.load and load_state_dict on every rank), and our write bandwidth, by each write path
(independent ``Write_at`` and collective ``Write_at_all``), against raw writes of the same bytes,
each rank writing its share (plain MPI-IO ``Write_at_all``, and h5py's ``mpio`` driver where
h5py is parallel), without and with the ``fsync`` a checkpoint needs before its rename. These
are measured in rounds, each round timing ours and every baseline once, alternating which goes
first; the median and the spread (the range over the median) are reported. Then the save, load
and reshard cases of :mod:`.checkpoint_scaling` at the launch's size. For a replicated
(plain Adam) checkpoint, the load's bytes read per rank and time against every rank reading the
whole file (the loader before replicated entries were read once and broadcast) and torch.load.
Save and load of ZeRO-Adam over 50,000 tiny parameters, where per-tensor work dominates, against
PyTorch's path again. The background save (``save_async``): how long it stalls training against
a blocking save of the same state, and a training step while the file is written against one
without."""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

import h5py
import numpy as np
import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import restore, writer
from tensorplay_hpc.checkpoint.replicas import Replicas
from tensorplay_hpc.bench import checkpoint_scaling
from tensorplay_hpc.bench.gloo import init_gloo
from tensorplay_hpc.bench.models import TINY_COUNT, mlp, tiny_parameters
from tensorplay_hpc.bench.report import Report
from tensorplay_hpc.bench.timing import compare, interleaved, spread
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["REPEAT", "run"]

REPEAT = 3   # PyTorch's consolidation takes seconds
TINY_REPEAT, TINY_WARMUP = 1, 0   # PyTorch's takes half a minute for the tiny parameters


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step, so that Adam's state exists."""
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


def _training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A forward, backward and optimizer step of the benchmark MLP on a batch of 32."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(32, model[0].in_features, generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return step


def _slowest(seconds: float, world: MPI.Intracomm) -> float:
    return world.allreduce(seconds, op=MPI.MAX)


def _background_save(report: Report, folder: str, world: MPI.Intracomm, repeat: int) -> None:
    """The stall of ``save_async`` against a blocking save of the same ZeRO-Adam state, and the
    training steps taken back to back while the file is written in the background (until every
    rank's write is done) against steps without one; the first step after the save returns is
    also reported alone. Each sample is the slowest rank's; the medians are reported."""
    model = mlp()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    step = _training_step(model, optimizer)
    step()

    def timed_step() -> float:
        started = time.perf_counter()
        step()
        return _slowest(time.perf_counter() - started, world)

    path = os.path.join(folder, "async.h5")
    blocking, stall, alone, during, first, write, spanned = [], [], [], [], [], [], []
    with checkpoint.AsyncCheckpointer(world) as checkpointer:
        for sample in range(repeat + 1):                      # the first is the warm-up
            world.Barrier()
            started = time.perf_counter()
            checkpoint.save(path, model, optimizer, process_group=world)
            blocking_s = _slowest(time.perf_counter() - started, world)
            world.Barrier()
            alone_s = timed_step()
            world.Barrier()
            started = time.perf_counter()
            handle = checkpointer.save(path, model, optimizer)
            stall_s = _slowest(time.perf_counter() - started, world)
            steps = [timed_step()]
            while not world.allreduce(handle.done(), op=MPI.LAND):
                steps.append(timed_step())
            handle.wait()
            if sample:
                blocking.append(blocking_s)
                stall.append(stall_s)
                alone.append(alone_s)
                first.append(steps[0])
                during.extend(steps)
                spanned.append(len(steps))
                write.append(_slowest(handle.write_seconds, world))
        host_bytes = world.allreduce(checkpointer.host_bytes)
    optimizer.close()
    median = statistics.median
    nbytes = os.path.getsize(path)
    report.add("checkpoint", "async save stall (zero adam)", median(stall), "blocking-save",
               median(blocking), nbytes=nbytes, background_write_s=median(write),
               host_buffer_bytes=host_bytes, threaded=checkpointer.threaded)
    report.add("checkpoint", "training step during async save", median(during), "training step",
               median(alone), samples=len(during), steps_per_write=median(spanned),
               first_step_after_save_s=round(median(first), 4))


def _raw_write(path: str, nbytes: int, world: MPI.Intracomm, through: str,
               durable: bool = False) -> Callable[[], None]:
    """The limit: ``nbytes`` of float32, each rank writing its contiguous share, ``through``
    h5py's ``mpio`` driver (one dataset; needs parallel h5py) or plain MPI-IO (``Write_at_all``
    on a file over ``world``); ``durable``: then rank 0 ``fsync``s the file, as a checkpoint
    save does before its rename."""
    n = nbytes // 4
    share = n // world.size
    start = world.rank * share
    stop = n if world.rank == world.size - 1 else start + share
    data = np.ones(stop - start, dtype=np.float32)

    def write() -> None:
        if through == "h5py":
            with h5py.File(path, "w", driver="mpio", comm=world) as f:
                f.create_dataset("data", shape=(n,), dtype=np.float32)[start:stop] = data
        else:
            handle = MPI.File.Open(world, path, MPI.MODE_WRONLY | MPI.MODE_CREATE)
            handle.Set_size(0)   # a new file, as h5py's "w" and a checkpoint's are
            handle.Write_at_all(start * 4, data)
            handle.Close()
        if durable and world.rank == 0:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        world.Barrier()
    return write


def _saved_by(way: str, path: str, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A blocking save of ``path`` through write path ``way`` (see :data:`.writer.WRITE_ENV`)."""
    def save() -> None:
        before = os.environ.get(writer.WRITE_ENV)
        os.environ[writer.WRITE_ENV] = way
        try:
            checkpoint.save(path, model, optimizer)
        finally:
            if before is None:
                del os.environ[writer.WRITE_ENV]
            else:
                os.environ[writer.WRITE_ENV] = before
    return save


def _write_bandwidth(report: Report, folder: str, world: MPI.Intracomm, nbytes: int) -> None:
    """Blocking saves of ZeRO-Adam over the MLP, by each write path, against raw writes of as
    many bytes (plain MPI-IO, and h5py's ``mpio`` driver where h5py is parallel), without and
    with the ``fsync`` that makes a checkpoint durable, in ``report.repeat`` rounds."""
    model = mlp()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _stepped(model, optimizer)
    raw = os.path.join(folder, "raw.h5")
    ways = ("independent", "collective")
    baselines = [(f"{name}{suffix}", _raw_write(raw, nbytes, world, through, durable))
                 for name, through in (("mpiio-raw", "mpiio"), ("h5py-raw", "h5py"))
                 if through == "mpiio" or h5py.get_config().mpi
                 for suffix, durable in (("", False), ("+fsync", True))]
    samples = interleaved(
        [*[_saved_by(way, os.path.join(folder, "ours.h5"), model, optimizer) for way in ways],
         *[write for _, write in baselines]], report.repeat, warmup=1)
    raw_samples = samples[len(ways):]
    for way, ours in zip(ways, samples):
        save_s = statistics.median(ours)
        for (baseline, _), theirs in zip(baselines, raw_samples):
            seconds = statistics.median(theirs)
            report.add("checkpoint", f"save write bandwidth ({way})", save_s, baseline, seconds,
                       nbytes=nbytes, ours_GBps=round(nbytes / save_s / 1e9, 3),
                       raw_GBps=round(nbytes / seconds / 1e9, 3), rounds=len(ours),
                       ours_spread=spread(ours), base_spread=spread(theirs))
    optimizer.close()


def _bytes_read(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                world: MPI.Intracomm) -> int:
    """The most dataset bytes one rank reads while loading ``path``."""
    with checkpoint.Reader(path) as reader:
        restore.load_into(reader, world, Replicas(world), model, optimizer)
        return world.allreduce(reader.bytes_read, op=MPI.MAX)


def _every_rank_reads(path: str, world: MPI.Intracomm):
    """Every rank reads and checks every dataset of the file, as loads did before."""
    def read() -> int:
        with checkpoint.Reader(path) as reader:
            reader.verify()
            world.Barrier()
            return reader.bytes_read
    return read


def _replicated_load(report: Report, folder: str, world: MPI.Intracomm) -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _stepped(model, optimizer)
    path = checkpoint.save(os.path.join(folder, "adam.h5"), model, optimizer)
    torch_path = os.path.join(folder, "adam.pt")
    if world.rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, torch_path)
    world.Barrier()

    def torch_load() -> None:
        saved = torch.load(torch_path, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    ours_bytes = _bytes_read(path, model, optimizer, world)
    old = _every_rank_reads(path, world)
    old_bytes = old()
    load_s, old_s, torch_s = compare([lambda: checkpoint.load(path, model, optimizer), old,
                                      torch_load], REPEAT, warmup=1)
    nbytes = os.path.getsize(path)
    for baseline, seconds in (("every-rank-reads", old_s), ("torch-save", torch_s)):
        report.add("checkpoint", "load (adam, replicated)", load_s, baseline, seconds,
                   nbytes=nbytes, ours_bytes_per_rank=ours_bytes, baseline_bytes_per_rank=(
                       old_bytes if baseline == "every-rank-reads" else os.path.getsize(torch_path)))


def _zero_save_and_load(report: Report, folder: str, world: MPI.Intracomm,
                        make_model: Callable[[], torch.nn.Module], what: str,
                        repeat: int = REPEAT, warmup: int = 1) -> int:
    """Save and load of ZeRO-Adam over ``make_model()``, ours against PyTorch's path; returns
    the file's size."""
    model = make_model()
    ours = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _stepped(model, ours)
    theirs_model = make_model()
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

    for case, pair in (("save", [lambda: checkpoint.save(ours_path, model, ours), torch_save]),
                       ("load", [lambda: checkpoint.load(ours_path, model, ours), torch_load])):
        mine, torch_s = interleaved(pair, repeat, warmup)
        report.add("checkpoint", f"{case} (zero adam{what})", statistics.median(mine),
                   "torch-save", statistics.median(torch_s), nbytes=os.path.getsize(ours_path),
                   rounds=len(mine), ours_spread=spread(mine), base_spread=spread(torch_s))
    nbytes = os.path.getsize(ours_path)
    ours.close()
    return nbytes


def run(report: Report) -> None:
    world = MPI.COMM_WORLD
    init_gloo(world)
    folder = world.bcast(tempfile.mkdtemp(prefix="tensorplay-bench-") if world.rank == 0 else None)
    try:
        nbytes = _zero_save_and_load(report, folder, world, mlp, "")
        _write_bandwidth(report, folder, world, nbytes)
        _replicated_load(report, folder, world)
        _background_save(report, folder, world, report.repeat)
        checkpoint_scaling.measure(report, folder, world)
        _zero_save_and_load(report, folder, world, tiny_parameters,
                            f", {TINY_COUNT:,} tiny parameters", TINY_REPEAT, TINY_WARMUP)
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
