"""Load: many small parameters, messages forced into many chunks, and a long run that must not
leak memory or MPI objects."""
import gc
import resource

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm import lifetime
from tensorplay_hpc.distributed.algorithms.model_averaging.utils import average_parameters
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

WORLD = MPI.COMM_WORLD


def many_parameters(count, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(1 + i % 5)) for i in range(count)]


@pytest.mark.timeout(300)
def test_ten_thousand_small_parameters():
    params = many_parameters(10_000)
    reference = [p.detach().clone().requires_grad_() for p in params]
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.5,
                                   parameters_as_bucket_view=True)
    plain = torch.optim.SGD(reference, lr=0.5)
    for step in range(2):
        for p, r in zip(params, reference):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            r.grad = p.grad.clone()
        zero.step()
        plain.step()
    for p, r in zip(params, reference):
        assert torch.equal(p.detach(), r.detach())
    # Average a replica-specific copy: every rank ends with the mean of the ranks' values.
    own = [torch.full_like(p, float(WORLD.Get_rank())) for p in params[:2000]]
    for t in own:
        t.grad = torch.zeros_like(t)
    average_parameters(own, WORLD)
    mean = (WORLD.Get_size() - 1) / 2
    assert all(torch.equal(t, torch.full_like(t, mean)) for t in own)


def test_forced_chunks_through_the_optimizers(setting):
    """A parameter 'over the count limit': with a 7-element chunk limit a 1000-element
    parameter travels in 143 chunks, through ZeRO's sync and DDP's gradient allreduce."""
    setting(comm.CHUNK_ENV, "7")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(40, 25), torch.nn.Linear(25, 1))   # 1025 + 26
    reference = torch.nn.Sequential(torch.nn.Linear(40, 25), torch.nn.Linear(25, 1))
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    size = WORLD.Get_size()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4 * size, 40, generator=g)
        mine = x[4 * WORLD.Get_rank():4 * (WORLD.Get_rank() + 1)]
        zero.zero_grad()
        ddp(mine).sum().backward()
        zero.step()
        plain.zero_grad()
        (reference(x).sum() / size).backward()
        plain.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)
def test_thousand_steps_without_leaks():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)   # several buckets
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3,
                                   parameters_as_bucket_view=True)
    x = torch.randn(8, 32)

    def steps(n):
        for _ in range(n):
            zero.zero_grad()
            ddp(x).pow(2).mean().backward()
            zero.step()
            average_parameters(list(model.parameters()), WORLD)

    steps(100)    # warm up: allocator pools, caches
    gc.collect()
    groups_before = len(lifetime.live())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB
    steps(1000)
    gc.collect()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert len(lifetime.live()) == groups_before
    assert grown_kib < 20 * 1024, f"peak memory grew by {grown_kib} KiB over 1000 steps"
    # the replicas stayed identical
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = torch.zeros(WORLD.Get_size() * flat.numel())
    pg = comm.ProcessGroup()
    comm.all_gather(gathered, flat, pg.comm)
    pg.close()
    assert all(torch.equal(part, flat) for part in gathered.split(flat.numel()))
