"""A lost rank seen through the comm layer with recovery on (3 ranks or more, launched with
ULFM): the last rank dies with SIGKILL after one allreduce (with the argument ``hang``, it
stops with SIGSTOP instead, alive but silent, for ULFM's heartbeat to find); every survivor
must see ``RankLost`` in its next collective, shrink to the survivors and allreduce again. The
last rank prints ``leaving at T``; each survivor prints ``lost RANKS in OPERATION at T``,
``shrunk to SIZE without LOST`` and ``sum SUM`` (T: ``time.time()``)."""
import os
import signal
import sys
import time

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.mpi import MPI

fault_tolerance.enable()
world = MPI.COMM_WORLD
rank, last = world.Get_rank(), world.Get_size() - 1
group = comm.ProcessGroup(world, owner="the rank-lost job")
value = torch.ones(4)
comm.all_reduce(value, group.comm)
if rank == last:
    print(f"[{rank}] leaving at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP if sys.argv[1:] == ["hang"] else signal.SIGKILL)
try:
    for _ in range(100):    # until the failure reaches this rank
        comm.all_reduce(value, group.comm)
    print(f"[{rank}] no failure seen", flush=True)
except fault_tolerance.RankLost as lost:
    print(f"[{rank}] lost {list(lost.ranks)} in {lost.operation} at {time.time():.6f}",
          flush=True)
survivors, gone = fault_tolerance.shrink(world)
print(f"[{rank}] shrunk to {survivors.Get_size()} without {gone}", flush=True)
total = torch.tensor([float(rank)])
comm.all_reduce(total, survivors)
print(f"[{rank}] sum {total.item():g}", flush=True)
if fault_tolerance.finalize_would_stall():    # as docs/reliability.md says a loop must end
    os._exit(0)
