"""A training job whose last rank stops (``SIGSTOP``) or stalls at one point of a step, for the
watchdog tests: the job must end through the watchdog, naming that rank, instead of hanging.

    stopped_rank_job.py CASE FOLDER

Every rank trains a small model under DistributedDataParallel with a ZeroRedundancyOptimizer and
saves a checkpoint into FOLDER (which every rank sees) after each step. At step
:data:`FAULT_STEP` (the second) the last rank, as CASE says:

- ``stop_<point>`` (a point of :data:`STOP_POINTS`): stops itself with ``SIGSTOP`` there;
- ``stall_save`` / ``stall_load``: sleeps :data:`STALL_S` before ``checkpoint.save`` / before
  ``checkpoint.load`` of the previous step's file, while the other ranks call it at once;
- ``stall_first_collective``: as ``stall_save`` in a job that has made no process group before
  (a plain model and ``torch.optim.SGD``), so the save's first collective is the library's first.

That rank prints the time (``time.time()``) at which it stops or begins to stall.
"""
import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

FAULT_STEP = 1
STALL_S = 40.0
"""How long a stalling rank sleeps: far beyond the watchdog's limit in the tests."""
STOP_POINTS: Dict[str, Optional[Tuple[str, str, str]]] = {
    "forward_hook": None,
    "backward_hook": None,
    "ddp_bucket_allreduce": ("all_reduce", "comm/collectives.py", "mpi-worker"),
    "zero_allgather": ("all_gather_v", "comm/collectives.py", "MainThread"),
    "consistency_check": ("gather_digests", "comm/consistency.py", "MainThread"),
    "checkpoint_write": ("write_own", "checkpoint/writer.py", "MainThread"),
}
"""Where a rank stops: in a hook of the model (``None``), or on entering the package's function
(name, file, and the start of the thread's name) that does that part of the step."""
CASES = tuple(f"stop_{point}" for point in STOP_POINTS) + (
    "stall_save", "stall_load", "stall_first_collective")


def _stop() -> None:
    print(f"stopping at {time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


class _Stopper:
    """Stops this process, once :meth:`arm` has been called, on entering the function
    ``target``: a profile function of the threads started from now on, and of this one once
    armed."""

    def __init__(self, target: Tuple[str, str, str]) -> None:
        self.target, self.armed = target, False
        threading.setprofile(self)

    def arm(self) -> None:
        self.armed = True
        sys.setprofile(self)

    def __call__(self, frame, event: str, arg: object) -> None:
        name, file, thread = self.target
        if (self.armed and event == "call" and frame.f_code.co_name == name
                and frame.f_code.co_filename.endswith(file)
                and threading.current_thread().name.startswith(thread)):
            self.armed = False
            _stop()


def _fault_on_last_rank(case: str, model: torch.nn.Module) -> Callable[[], None]:
    """Set up ``case``'s fault; return what arms it (on the last rank; a no-op elsewhere)."""
    world = MPI.COMM_WORLD
    if world.Get_rank() != world.Get_size() - 1 or not case.startswith("stop_"):
        return lambda: None
    point = case[len("stop_"):]
    armed = [False]

    def stop_if_armed(*_: object) -> None:
        if armed[0]:
            armed[0] = False
            _stop()

    if point == "forward_hook":
        model[0].register_forward_hook(stop_if_armed)
    elif point == "backward_hook":
        model[0].weight.register_hook(stop_if_armed)
    else:
        return _Stopper(STOP_POINTS[point]).arm
    return lambda: armed.__setitem__(0, True)


def main(case: str, folder: str) -> None:
    world = MPI.COMM_WORLD
    world.Barrier()     # start together: under load, the ranks' imports end seconds apart
    late = world.Get_rank() == world.Get_size() - 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    arm = _fault_on_last_rank(case, model)
    if case == "stall_first_collective":
        net: torch.nn.Module = model
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        net = DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD,
                                            lr=0.1)
    for step in range(FAULT_STEP + 1):
        if step == FAULT_STEP:
            arm()
        net(torch.randn(16, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        path = os.path.join(folder, f"step-{step}.h5")
        if case == "stall_first_collective" and step == FAULT_STEP:
            world.Barrier()   # no collective has kept the ranks in step: rank 0 waits from now
        if case.startswith("stall_") and step == FAULT_STEP and late:
            print(f"stalling at {time.time()}", flush=True)
            time.sleep(STALL_S)
        if case == "stall_load" and step == FAULT_STEP:
            checkpoint.load(os.path.join(folder, f"step-{step - 1}.h5"), model, optimizer)
        elif case != "stall_first_collective" or step == FAULT_STEP:
            checkpoint.save(path, model, optimizer)
    print("not reached", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
