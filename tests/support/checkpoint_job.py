"""An MPI job for the checkpoint tests that need their own world size or a killed rank.

    checkpoint_job.py save FILE STEPS            train ZeRO-Adam STEPS steps, then save
    checkpoint_job.py resume FILE STEPS OUT      load, train STEPS more, rank 0 saves params
    checkpoint_job.py kill-during-save FILE      save FILE, then die on the last rank while
                                                 saving FILE again
    checkpoint_job.py kill-during-async-save FILE
                                                 save FILE, then save it again in the background
                                                 and train on; the last rank's writer thread
                                                 kills its process in the middle of the write
    checkpoint_job.py grow FILE MB               save FILE, then try to save it again with MB
                                                 more megabytes (run it under a file-size limit)
    checkpoint_job.py fill FILE BYTES            save FILE, then save it again while another file
                                                 fills its disk but for BYTES, once the save has
                                                 checked the free space
"""
import os
import shutil
import signal
import sys

import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import files
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer


def say(line: str) -> None:
    """Print ``line`` in one write, so that the lines of several ranks never run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 7),
                               torch.nn.Tanh(), torch.nn.Linear(7, 2))


def train(model, optimizer, start, steps):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 5, generator=g), torch.randn(16, 2, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def main(mode, path, *rest):
    model = make_model()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    if mode == "save":
        train(model, optimizer, 0, int(rest[0]))
        checkpoint.save(path, model, optimizer, extra={"step": int(rest[0])})
    elif mode == "resume":
        start = checkpoint.load(path, model, optimizer)["step"]
        train(model, optimizer, start, int(rest[0]))
        if MPI.COMM_WORLD.Get_rank() == 0:
            torch.save([p.detach() for p in model.parameters()], rest[1])
    elif mode in ("kill-during-save", "kill-during-async-save"):
        train(model, optimizer, 0, 2)
        checkpoint.save(path, model, optimizer, extra={"step": 2})
        train(model, optimizer, 2, 1)
        if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
            from tensorplay_hpc.checkpoint import writer

            def die(*args):
                os.kill(os.getpid(), signal.SIGKILL)
            writer.write_own = die
        if mode == "kill-during-save":
            checkpoint.save(path, model, optimizer, extra={"step": 3})
        else:
            handle = checkpoint.save_async(path, model, optimizer, extra={"step": 3})
            train(model, optimizer, 3, 20)
            handle.wait()
    elif mode == "grow":
        checkpoint.save(path, model, optimizer, extra={"step": 1})
        padding = torch.ones(int(rest[0]) * 2**18)      # MB megabytes of float32
        try:
            checkpoint.save(path, model, optimizer, extra={"step": 2, "padding": padding})
        except checkpoint.CheckpointError as error:
            say(f"save failed: {error}")
        step = checkpoint.load(path, model, optimizer)["step"]
        say(f"rank {MPI.COMM_WORLD.Get_rank()} loaded step {step}")
    elif mode == "fill":
        checkpoint.save(path, model, optimizer, extra={"step": 1})
        filler = os.path.join(os.path.dirname(path), "filler")
        check_space = files.check_space

        def check_then_fill(probe, nbytes):
            check_space(probe, nbytes)
            free = shutil.disk_usage(os.path.dirname(path)).free
            with open(filler, "wb") as out:
                out.write(b"x" * max(free - int(rest[0]), 0))
        files.check_space = check_then_fill
        try:
            checkpoint.save(path, model, optimizer, extra={"step": 2})
        except checkpoint.CheckpointError as error:
            say(f"save failed: {error}")
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.Get_rank() == 0:
            os.remove(filler)
        MPI.COMM_WORLD.Barrier()
        step = checkpoint.load(path, model, optimizer)["step"]
        say(f"rank {MPI.COMM_WORLD.Get_rank()} loaded step {step}")


if __name__ == "__main__":
    main(*sys.argv[1:])
