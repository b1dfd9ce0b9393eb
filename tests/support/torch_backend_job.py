"""A job that starts torch.distributed on the mpi4py backend the way a user does, with no
MASTER_ADDR: ``dist.init_process_group("mpi4py")``. It checks the MPI store, a gloo group that
meets its peers through that store, PyTorch's DDP on the default group against the same over
gloo, and FSDP2 on a mesh of the default group against a local Adam; rank 0 prints ``ALL OK``."""
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import tensorplay_hpc.distributed  # noqa: F401  (registers the backend)
from tensorplay_hpc.distributed.backend import MPIProcessGroup


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def batches(size):
    for step in range(3):
        torch.manual_seed(50 + step)
        yield torch.randn(2 * size, 6, dtype=torch.float64)


def main() -> None:
    assert "MASTER_ADDR" not in os.environ
    dist.init_process_group("mpi4py")
    from mpi4py import MPI
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (rank, size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert isinstance(dist.group.WORLD, MPIProcessGroup) and dist.get_backend() == "mpi4py"

    store = dist.distributed_c10d._get_default_store()
    store.set(f"rank{rank}", f"hello from {rank}")
    assert store.add("arrived", 1) >= 1
    store.wait([f"rank{r}" for r in range(size)])
    assert [store.get(f"rank{r}") for r in range(size)] == \
        [f"hello from {r}".encode() for r in range(size)]
    dist.barrier()
    assert store.get("arrived") == str(size).encode()
    won = store.compare_set("leader", "", str(rank))
    dist.barrier()
    assert store.get("leader") == won if won == store.get("leader") else True
    leaders = [None] * size
    dist.all_gather_object(leaders, store.get("leader"))
    assert len(set(leaders)) == 1

    gloo = dist.new_group(backend="gloo")   # gloo meets its peers through the MPI store
    results = []
    for group in (dist.group.WORLD, gloo):
        ddp = nn.parallel.DistributedDataParallel(model(), process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for x in batches(size):
            ddp(x[2 * rank:2 * rank + 2]).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach() for p in ddp.parameters()])
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0 if size <= 2 else 1e-12)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    sharded, local = model(), model()
    fully_shard(sharded[0], mesh=init_device_mesh("cpu", (size,)))
    fully_shard(sharded, mesh=init_device_mesh("cpu", (size,)))
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (sharded, local)]
    for x in batches(size):
        sharded(x[2 * rank:2 * rank + 2]).pow(2).sum().backward()
        (local(x).pow(2).sum() / size).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for mine, reference in zip(sharded.parameters(), local.parameters()):
        torch.testing.assert_close(mine.full_tensor(), reference.detach(), rtol=1e-12,
                                   atol=1e-12)
    dist.destroy_process_group()
    if rank == 0:
        print(f"ALL OK on {size} ranks", flush=True)


def wrong_world_size() -> None:
    dist.init_process_group("mpi4py", rank=0, world_size=99)


def one_rank_all_reduce() -> None:
    """Rank 0 alone calls ``dist.all_reduce``; the others wait in a barrier of their own."""
    dist.init_process_group("mpi4py")
    from mpi4py import MPI
    if dist.get_rank() == 0:
        print(f"calling at {time.time()}", flush=True)
        dist.all_reduce(torch.ones(4))
    else:
        MPI.COMM_WORLD.Barrier()
    print("not reached", flush=True)


def on_parts() -> None:
    """torch.distributed over each half of the world (even and odd world ranks), a subgroup
    and an FSDP2 step there, then again over the whole world: prints ``PARTS OK``."""
    from mpi4py import MPI
    from torch.distributed.fsdp import fully_shard
    from tensorplay_hpc.distributed.backend import init_process_group
    world = MPI.COMM_WORLD
    part = world.Split(world.Get_rank() % 2, world.Get_rank())
    init_process_group(part)
    assert (dist.get_rank(), dist.get_world_size()) == (part.Get_rank(), part.Get_size())
    total = torch.tensor([float(world.Get_rank())])
    dist.all_reduce(total)
    assert total.item() == sum(r for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2)
    first = dist.new_group([0])
    if dist.get_rank() == 0:
        alone = torch.ones(1)
        dist.all_reduce(alone, group=first)
        assert alone.item() == 1.0
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = fully_shard(torch.nn.Linear(8, 8), mesh=mesh)
    sharded(torch.ones(2, 8)).sum().backward()
    dist.destroy_process_group()
    part.Free()
    init_process_group()
    everyone = torch.ones(1)
    dist.all_reduce(everyone)
    assert everyone.item() == world.Get_size()
    dist.destroy_process_group()
    print(f"PARTS OK on {world.Get_size()} ranks", flush=True)


if __name__ == "__main__":
    {"main": main, "wrong_world_size": wrong_world_size, "on_parts": on_parts,
     "one_rank_all_reduce": one_rank_all_reduce}[sys.argv[1]]()
