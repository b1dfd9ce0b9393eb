"""ZeroRedundancyOptimizer overlapped with DistributedDataParallel (``overlap_with_ddp=True`` and
the hooks of ``ddp_zero_hook``): PyTorch's own scenario (warm-up passes that do not step, then
parity with DDP and a local optimizer), parity with PyTorch's overlap over gloo, PyTorch's
bucket assignments, and ZeRO-2 (``hook_with_zero2_step``): parity, no gradients kept, and its
checkpoints."""
import os

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer
from torch.distributed.optim.zero_redundancy_optimizer import _OverlapStatus

from tensorplay_hpc import checkpoint
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
    hook_with_zero2_step, hook_with_zero_step, hook_with_zero_step_interleaved)
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.optim.bucket_assignment import sharded_buckets
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

HOOKS = {"after_last": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}
SGD = (torch.optim.SGD, dict(lr=0.01, momentum=0.9, weight_decay=0.001))   # PyTorch's test
ADAM = (torch.optim.Adam, dict(lr=0.01))
ADAMW = (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))
BUCKET_CAP_MB = 0.001   # about 1 KiB: one bucket per layer, and one of the empty parameter


def _model():
    """Layers of different sizes (so that sharded buckets split) and a zero-element parameter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.Linear(40, 30),
                                torch.nn.Linear(30, 30), torch.nn.Linear(30, 10))
    model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))
    return model


def _loss(model, x):
    return (model(x) + model.module.empty.sum()).sum()


def _inputs(rank, count=5):
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 20, generator=generator) for _ in range(count)]


def _run_overlapped(ddp, zero, inputs, warmup):
    """PyTorch's test loop: ``warmup`` passes without zero_grad, then one pass per input."""
    for x in inputs[:warmup]:
        _loss(ddp, x).backward()
    for x in inputs:
        zero.zero_grad()
        _loss(ddp, x).backward()


def _run_local(ddp, optimizer, inputs):
    for x in inputs:
        optimizer.zero_grad()
        _loss(ddp, x).backward()
        optimizer.step()


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("shard_buckets", [False, True])
@pytest.mark.parametrize("static_graph", [False, True])
@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["SGD", "Adam"])
def test_matches_ddp_with_a_local_optimizer(world, hook, shard_buckets, static_graph, optimizer):
    optimizer_class, kwargs = optimizer
    inputs = _inputs(world.Get_rank())
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB,
                                  gradient_as_bucket_view=shard_buckets)
    if static_graph:
        ddp._set_static_graph()
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class, overlap_with_ddp=True,
                                   **kwargs)
    ddp.register_comm_hook(None, HOOKS[hook](allreduce_hook, ddp, zero,
                                             shard_buckets=shard_buckets))
    assert [len(b.parameters()) for b in ddp.buckets] == [2, 2, 2, 2, 1]
    # The reference reduces with the same hook, so the gradients are equal bit for bit.
    reference = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB,
                                        static_graph=static_graph)
    reference.register_comm_hook(None, allreduce_hook)
    local = optimizer_class(reference.parameters(), **kwargs)
    initial = [p.detach().clone() for p in ddp.parameters()]
    warmup = 3 if static_graph else 2
    for x in inputs[:warmup]:   # the warm-up averages gradients but does not step
        _loss(ddp, x).backward()
        for p, q in zip(ddp.parameters(), initial):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    _run_overlapped(ddp, zero, inputs, warmup=0)
    _run_local(reference, local, inputs)
    for p, q in zip(ddp.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert any(not torch.equal(p, q) for p, q in zip(ddp.parameters(), initial))
    with pytest.warns(UserWarning, match="does nothing"):
        assert zero.step() is None


def _mixed_model():
    """The overlap model with its second layer in bfloat16: a bucket of each dtype."""
    model = _model()
    model[1].to(torch.bfloat16)
    return _Casting(model)


class _Casting(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.empty = model.empty

    def forward(self, x):
        for layer in self.model:
            x = layer(x.to(layer.weight.dtype))
        return x.float()


@pytest.mark.parametrize("shard_buckets", [True, False])
@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("optimizer", [SGD, ADAM, ADAMW], ids=["SGD", "Adam", "AdamW"])
def test_zero2_matches_ddp_with_a_local_optimizer_and_keeps_no_gradients(
        world, shard_buckets, bucket_view, mixed, optimizer):
    """Gradients reach only their owners (a reduce per part instead of the reference's
    allreduce: sums in another order, so equal to rounding), the owners step, and after each
    backward pass no parameter has a gradient and DDP holds no bucket buffer."""
    optimizer_class, kwargs = optimizer
    make = _mixed_model if mixed else _model
    inputs = _inputs(world.Get_rank())
    ddp = DistributedDataParallel(make(), bucket_cap_mb=BUCKET_CAP_MB,
                                  gradient_as_bucket_view=bucket_view)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class, overlap_with_ddp=True,
                                   **kwargs)
    ddp.register_comm_hook(None, hook_with_zero2_step(ddp, zero, shard_buckets=shard_buckets))
    reference = DistributedDataParallel(make(), bucket_cap_mb=BUCKET_CAP_MB)
    reference.register_comm_hook(None, allreduce_hook)   # the warm-up's arithmetic
    local = optimizer_class(reference.parameters(), **kwargs)
    for x in inputs[:2]:        # the warm-up averages into .grad, as the plain overlap does
        _loss(ddp, x).backward()
    warm = [p.grad.clone() for p in ddp.parameters()]
    for x in inputs:
        zero.zero_grad()
        _loss(ddp, x).backward()
        assert all(p.grad is None for p in ddp.parameters())
        assert all(bucket._flat is None for bucket in ddp.buckets)
    for x in inputs[:2]:
        _loss(reference, x).backward()
    for p, q in zip(warm, reference.parameters()):
        torch.testing.assert_close(p, q.grad, rtol=0, atol=0)
    _run_local(reference, local, inputs)
    tolerance = dict(rtol=1e-2, atol=1e-2) if mixed else dict(rtol=1e-5, atol=1e-6)
    for p, q in zip(ddp.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **tolerance)
    # every rank holds the same parameters, and the state lives with the owners only
    flat = torch.cat([p.detach().float().reshape(-1) for p in ddp.parameters()])
    assert all(torch.equal(flat, other) for other in world.allgather(flat))
    owned = sum(p.numel() for p in zero.optim.state)
    assert world.allreduce(owned) == sum(p.numel() for p in ddp.parameters() if p.numel())


def test_zero2_checkpoint_resumes_in_ddp_with_a_plain_optimizer(world, folder):
    """Each owner writes its part of the state; a plain Adam loads all of it, each rank alone
    (a load at 1 rank of a file saved by all), and continues as ZeRO-2 does (the same
    arithmetic, sums in another order)."""
    inputs = _inputs(world.Get_rank(), count=5)
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True,
                                   lr=0.01)
    ddp.register_comm_hook(None, hook_with_zero2_step(ddp, zero))
    _run_overlapped(ddp, zero, inputs[:3], warmup=2)
    path = checkpoint.save(os.path.join(folder, "zero2.h5"), ddp, zero)
    _run_overlapped(ddp, zero, inputs[3:], warmup=0)
    resumed = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    plain = torch.optim.Adam(resumed.parameters(), lr=0.5)
    checkpoint.load(path, resumed, plain, process_group=MPI.COMM_SELF)
    assert plain.param_groups[0]["lr"] == 0.01
    assert all(int(s["step"]) == 3 for s in plain.state.values())
    _run_local(resumed, plain, inputs[3:])
    for p, q in zip(ddp.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard_buckets", [False, True])
@pytest.mark.parametrize("static_graph", [False, True])
def test_matches_torch_overlap_over_gloo(world, gloo, monkeypatch, shard_buckets, static_graph):
    """PyTorch refuses gloo for its overlap (its interleaved hook may hang there, pytorch#62300);
    its ``hook_with_zero_step`` runs on gloo, so the refusal is lifted for it here."""
    rank = world.Get_rank()
    inputs = _inputs(rank)
    warmup = 3 if static_graph else 2
    theirs = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB,
                                                       static_graph=static_graph)
    their_zero = TorchZeroRedundancyOptimizer(theirs.parameters(), torch.optim.SGD,
                                              overlap_with_ddp=True, **SGD[1])
    with monkeypatch.context() as patch:
        patch.setattr(dist, "get_backend", lambda group=None: "nccl")
        their_hook = torch_zero_hook.hook_with_zero_step(
            torch_default_hooks.allreduce_hook, theirs, their_zero, shard_buckets=shard_buckets)
    theirs.register_comm_hook(None, their_hook)
    _run_overlapped(theirs, their_zero, inputs, warmup)
    for hook in sorted(HOOKS):
        ours = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB,
                                       static_graph=static_graph)
        zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                       **SGD[1])
        ours.register_comm_hook(None, HOOKS[hook](allreduce_hook, ours, zero,
                                                  shard_buckets=shard_buckets))
        _run_overlapped(ours, zero, inputs, warmup)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q)
    # PyTorch's assignment of its own buckets is ours for the same buckets.
    info = their_zero._overlap_info
    buckets = [[p.numel() for p in params] for params in info.params_per_bucket]
    expected = {(b, rank, a.offset, a.offset + len(a.parameters))
                for rank, assignments in enumerate(their_zero._bucket_assignments_per_rank)
                for b, a in assignments.items()}
    if shard_buckets:
        shards = sharded_buckets(buckets, world.Get_size())
    else:
        shards = [[(b, b % world.Get_size(), 0, len(n))] for b, n in enumerate(buckets)]
    assert {tuple(s) for per_bucket in shards for s in per_bucket} == expected


@pytest.mark.mpi(min_size=2)
def test_sharded_buckets_match_torch_assignment(world, gloo):
    """PyTorch's assignment computed from bucket layouts of many shapes."""
    size = world.Get_size()
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    their_zero = TorchZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True,
                                              lr=0.1)
    info = their_zero._overlap_info
    compared = 0
    for _ in range(40):
        layout = [[int(n) for n in torch.randint(0, 50, (int(k),), generator=generator)]
                  for k in torch.randint(1, 6, (int(torch.randint(1, 7, (1,)).item()),),
                                         generator=generator)]
        info.__init__(size)
        info.shard_buckets = True
        info.status = _OverlapStatus.INITIALIZED
        info.params_per_bucket = [[torch.zeros(n) for n in bucket] for bucket in layout]
        info.total_size = sum(map(sum, layout))
        their_zero._bucket_assignments_per_rank_cache = []
        try:
            theirs = {(b, rank, a.offset, a.offset + len(a.parameters))
                      for rank, assignments in enumerate(their_zero._bucket_assignments_per_rank)
                      for b, a in assignments.items()}
        except AssertionError:   # PyTorch cannot place a bucket cut in more runs than ranks
            continue
        ours = {tuple(s) for per_bucket in sharded_buckets(layout, size) for s in per_bucket}
        assert ours == theirs, layout
        compared += 1
    assert compared >= 20


def test_warm_up_counts_synchronized_passes_only(world):
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                   lr=0.1)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    initial = [p.detach().clone() for p in ddp.parameters()]
    x = _inputs(world.Get_rank())[0]
    with ddp.no_sync():
        _loss(ddp, x).backward()
    for _ in range(2):
        _loss(ddp, x).backward()
    assert zero.ddp_overlap.iterations == 2
    assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), initial))
    _loss(ddp, x).backward()
    assert zero.ddp_overlap.iterations == 3
    assert not torch.equal(ddp.module[0].weight, initial[0])


def test_hook_errors():
    ddp = DistributedDataParallel(_model())
    plain = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    for make_hook in HOOKS.values():
        with pytest.raises(ValueError, match="must be constructed with `overlap_with_ddp=True`"):
            make_hook(allreduce_hook, ddp, plain)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                   lr=0.1)
    hook_with_zero_step_interleaved(allreduce_hook, ddp, zero, shard_buckets=True)
    with pytest.raises(RuntimeError, match="already overlapped"):
        hook_with_zero_step(allreduce_hook, ddp, zero)
