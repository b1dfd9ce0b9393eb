"""A DistributedOptimizer loop that survives a lost owner (launched with ULFM): every rank owns
one layer of a small network and trains all of it with Adam through one-sided steps, committing
each step with ``DistributedOptimizerCopies``.

Arguments: VICTIMS KILL_AFTER STEPS [DELAY [EVERY [WIDTH]]]. The world ranks VICTIMS (comma-separated,
or ``none``) die with SIGKILL after step KILL_AFTER, at once or DELAY seconds after, in a later
step (maybe holding a lock on an owner). Every EVERY-th step is committed (default 1; 0: none
after the first). The layers are WIDTH x WIDTH (default 8). The survivors recover, check that the parameters and Adam's state
they go on from are bit for bit those they committed at that step, and finish STEPS steps.

Each rank prints ``transport T``; a victim ``leaving at T``; each survivor, once it can step
again, ``recovered step S of KILL_AFTER, lost LOST, owning N tensors, state same|DIFFERENT, at
T``, and at the end ``finished STEP loss L digest D`` and ``mean step M ms`` (of the steps
after the second, which without VICTIMS take no digests; T: ``time.time()``)."""
import hashlib
import os
import signal
import sys
import threading
import time

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm import fault_tolerance
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import barrier
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer
from tensorplay_hpc.distributed.optim.distributed_optimizer_copies import (
    DistributedOptimizerCopies)

victims = [] if sys.argv[1] == "none" else [int(r) for r in sys.argv[1].split(",")]
kill_after, steps = int(sys.argv[2]), int(sys.argv[3])
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
every = int(sys.argv[5]) if len(sys.argv) > 5 else 1
WIDTH = int(sys.argv[6]) if len(sys.argv) > 6 else 8
fault_tolerance.enable()
world = MPI.COMM_WORLD
rank = world.Get_rank()
torch.manual_seed(rank)
layer = torch.nn.Linear(WIDTH, WIDTH)


def build(group, tensors, origins=None):
    shared = rma.share(tensors, group)
    optimizer = DistributedOptimizer(torch.optim.Adam, shared.refs, lr=0.01)
    return shared, optimizer, DistributedOptimizerCopies(optimizer, origins)


def digest(copies, optimizer):
    """SHA-256 of every parameter and its Adam state, in origin order (read by this rank)."""
    h = hashlib.sha256()
    for ref in copies.refs:
        h.update(ref.to_here().detach().numpy().tobytes())
        for key, value in sorted(optimizer.state_of(ref).items()):
            h.update(key.encode())
            h.update(value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()


def leave():
    print(f"[{rank}] leaving at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def train(step, copies, optimizer, position, trainers):
    generator = torch.Generator().manual_seed(1000 * step + position)
    x = torch.randn(4 * 4 // trainers + 1, WIDTH, generator=generator)
    with autograd.context() as context_id:
        weights = [ref.to_here() for ref in copies.refs]
        for w, b in zip(weights[0::2], weights[1::2]):
            x = torch.tanh(torch.nn.functional.linear(x, w, b))
        loss = x.pow(2).mean()
        autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    return loss.detach().reshape(1)


shared, optimizer, copies = build(world, list(layer.parameters()))
print(f"[{rank}] transport {shared.transport}", flush=True)
group = comm.ProcessGroup(world, owner="the DistributedOptimizer recovery job")
digests = {0: digest(copies, optimizer)}
copies.commit(0)
step, loss, started = 0, torch.zeros(1), {}
while step < steps:
    try:
        started[step + 1] = time.perf_counter()
        loss = train(step + 1, copies, optimizer, group.rank, group.size)
        comm.all_reduce(loss, group.comm)      # every trainer has stepped
        if every and (step + 1) % every == 0:
            if victims:                        # what the survivors will compare against
                digests[step + 1] = digest(copies, optimizer)
            copies.commit(step + 1)
        step += 1
        if rank in victims and step == kill_after:
            if delay:
                threading.Timer(delay, leave).start()
            else:
                leave()
    except fault_tolerance.RankLost:
        world, lost, adopted = copies.recover(world)
        shared, optimizer, copies = build(world, adopted.tensors, adopted.origins)
        adopted.load(optimizer)
        group = comm.ProcessGroup(world, owner="the DistributedOptimizer recovery job")
        barrier(group.comm)                    # every owner has loaded its state
        step = adopted.step
        same = digest(copies, optimizer) == digests[step]
        copies.commit(step)
        print(f"[{rank}] recovered step {step} of {kill_after}, lost {lost}, owning "
              f"{len(adopted.tensors)} tensors, state {'same' if same else 'DIFFERENT'}, at "
              f"{time.time():.6f}", flush=True)
ended = time.perf_counter()
print(f"[{rank}] finished {step} loss {loss.item() / group.size:.6f} digest "
      f"{digest(copies, optimizer)}", flush=True)
print(f"[{rank}] mean step {(ended - started[3]) / (steps - 2) * 1e3:.2f} ms", flush=True)
barrier(group.comm)
if fault_tolerance.finalize_would_stall():
    os._exit(0)
copies.close()
optimizer.close()
shared.close()
group.close()
