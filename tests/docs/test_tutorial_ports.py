"""Idioms of PyTorch's published tutorials that must behave as in PyTorch: a backward pass
through ``ddp.module`` (a forward pass that bypassed DDP) keeps its gradients local, a CPU
module with ``device_ids=[rank]`` is refused with PyTorch's own error on each rank, and
distributed autograd refuses roots it cannot start from."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

SMALL_BUCKETS_MB = 0.0005   # several buckets for the model below


def _mlp():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _loss(model, rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
    return F.mse_loss(model(x), y)


def _grads(ddp):
    return [None if p.grad is None else p.grad.clone() for p in ddp.module.parameters()]


def _assert_same(ours, theirs):
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_scalar_bypass_and_second_backward_stay_local(world):
    """w = 1, x = rank + 1: the loss 2 w x through ``ddp.module`` gives each rank its own
    gradient 2 x (2 and 4 on two ranks, as PyTorch); through DDP, w x gives the mean of x, and
    a second backward pass through the same graph (``retain_graph``) adds this rank's x."""
    rank, size = world.Get_rank(), world.Get_size()
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = DistributedDataParallel(model)
    x = torch.tensor([[rank + 1.0]])
    (ddp.module(x) * 2).sum().backward()
    assert model.weight.grad.item() == 2.0 * (rank + 1)
    model.weight.grad = None
    output = ddp(x).sum()
    output.backward(retain_graph=True)
    assert model.weight.grad.item() == (size + 1) / 2
    output.backward()
    assert model.weight.grad.item() == (size + 1) / 2 + rank + 1


@pytest.mark.parametrize("variant", ["default", "bucket_view", "allreduce_hook"])
def test_backward_through_the_bare_module_matches_torch_ddp(world, gloo, variant):
    """Bypassed forward passes on every rank, after a synchronized pass, and on rank 0 only
    (without a hang), each followed by a synchronized pass, give PyTorch's gradients."""
    rank = world.Get_rank()
    ours = DistributedDataParallel(_mlp(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                   gradient_as_bucket_view=variant == "bucket_view")
    if variant == "allreduce_hook":
        ours.register_comm_hook(None, allreduce_hook)
    theirs = torch.nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=SMALL_BUCKETS_MB)
    assert len(ours.buckets) > 1
    steps = [("bypass", True), ("ddp", True), ("bypass", True), ("bypass", rank == 0),
             ("ddp", True), ("ddp", True), ("bypass", rank != 0)]
    for step, (path, here) in enumerate(steps):
        grads = []
        for ddp in (ours, theirs):
            if here:
                _loss(ddp.module if path == "bypass" else ddp, rank, step).backward()
            grads.append(_grads(ddp))
        _assert_same(*grads)
        if step == 0:   # a local gradient: this rank's loss only
            local = _mlp()
            _loss(local, rank, 0).backward()
            _assert_same(grads[0], [p.grad for p in local.parameters()])
        if path == "ddp":   # averaged: the same on every rank
            for mine, first in zip(grads[0], world.bcast(grads[0], root=0)):
                assert torch.equal(mine, first)
            for ddp in (ours, theirs):
                ddp.zero_grad()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("arguments", [lambda rank: {"device_ids": [rank]},
                                       lambda rank: {"output_device": rank + 1}],
                         ids=["device_ids", "output_device"])
def test_cpu_module_with_a_device_per_rank_is_pytorchs_error(world, gloo, arguments):
    """``DDP(cpu_module, device_ids=[rank])`` from the GPU tutorials: each rank raises
    PyTorch's ``ValueError``, naming its own devices, not a disagreement between ranks."""
    mine = arguments(world.Get_rank())
    with pytest.raises(Exception) as theirs:
        torch.nn.parallel.DistributedDataParallel(_mlp(), **mine)
    with pytest.raises(Exception) as ours:
        DistributedDataParallel(_mlp(), **mine)
    assert (ours.type, str(ours.value)) == (theirs.type, str(theirs.value))
    [(name, value)] = mine.items()
    assert ours.type is ValueError and f"{name} {value}," in str(ours.value)


def test_autograd_refuses_roots_as_pytorch(world):
    """PyTorch's distributed autograd raises ``RuntimeError`` for a root that does not require
    grad ("requires_grad not set on root"), one that is not a scalar, and a leaf."""
    rank = world.Get_rank()
    weight = torch.full((3,), float(rank + 1), requires_grad=True)
    with rma.share([weight]) as shared:
        [ref] = shared.refs_of(rank)
        with autograd.context() as context_id:
            value = ref.to_here()
            for root, problem in [
                    (value.detach().sum(), r"requires_grad not set on root"),
                    (value * 2, r"root of shape \(3,\) is not a scalar, all roots need to be "
                                r"scalar"),
                    (torch.ones((), requires_grad=True),
                     r"root does not have a valid gradient function")]:
                with pytest.raises(RuntimeError, match=rf"^distributed autograd backward: "
                                                       rf"{problem}.*\(root 1 of 2, world rank "
                                                       rf"{rank}\)$"):
                    autograd.backward(context_id, [value.sum(), root])
            assert autograd.get_gradients(context_id) == {}   # nothing was sent
            autograd.backward(context_id, [(value * value).sum()])
            torch.testing.assert_close(autograd.get_gradients(context_id)[ref],
                                       torch.full((3,), 2.0 * (rank + 1)))
        world.Barrier()
