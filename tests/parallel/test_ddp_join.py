"""DistributedDataParallel with uneven inputs (Join): parity with PyTorch's DDP join over gloo,
alone and with ZeroRedundancyOptimizer, for both divisors, and throw_on_early_termination."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook as torch_allreduce_hook,
)

from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
)
from tensorplay_hpc.distributed.algorithms.join import Join, Joinable
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

SMALL_BUCKETS_MB = 0.0005   # several buckets for the model below


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches(rank):
    """Rank r has 3 + r batches."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator))
            for _ in range(3 + rank)]


def _train(model, optimizer, context, batches):
    with context:
        for x, y in batches:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()


def _state(model):
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _assert_same(ours, theirs):
    for a, b in zip(_state(ours), _state(theirs)):
        torch.testing.assert_close(a, b)


def _assert_same_on_every_rank(world, model, parameters_only=False):
    """After a join, parameters and buffers are the last joiner's everywhere."""
    tensors = [p.detach() for p in model.parameters()] if parameters_only else _state(model)
    for mine, first in zip(tensors, world.bcast(tensors, root=0)):
        torch.testing.assert_close(mine, first, rtol=0, atol=0)


def test_ddp_is_joinable(world):
    ddp = DistributedDataParallel(_model(0))
    assert isinstance(ddp, Joinable)
    assert ddp.join_device == torch.device("cpu")
    assert ddp.join_process_group is world
    assert isinstance(ddp.join(), Join)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
@pytest.mark.parametrize("variant", ["default", "bucket_view", "allreduce_hook"])
def test_uneven_inputs_match_torch_ddp_join(world, gloo, divide_by_initial_world_size, variant):
    rank = world.Get_rank()
    module = _model(seed=rank)
    ours = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=SMALL_BUCKETS_MB,
                                   gradient_as_bucket_view=variant == "bucket_view")
    theirs = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(module), bucket_cap_mb=SMALL_BUCKETS_MB,
        gradient_as_bucket_view=variant == "bucket_view")
    if variant == "allreduce_hook":
        ours.register_comm_hook(None, allreduce_hook)
        theirs.register_comm_hook(None, torch_allreduce_hook)
    assert len(ours.buckets) > 1
    for model in (ours, theirs):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(model, optimizer, model.join(divide_by_initial_world_size), _batches(rank))
    _assert_same(ours, theirs)
    _assert_same_on_every_rank(world, ours)


@pytest.mark.mpi(min_size=2)
def test_divisor_is_what_join_says(world):
    """Only the last rank trains in its last iteration: its gradient is divided by the group
    size, or by 1 with divide_by_initial_world_size=False."""
    rank, size = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    grads = {}
    for divide in (True, False):
        ddp = DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
        with ddp.join(divide_by_initial_world_size=divide):
            for step in range(1 + (rank == size - 1)):
                ddp.zero_grad()
                ddp(torch.full((1, 2), float(step + 1))).sum().backward()
        grads[divide] = ddp.module.weight.grad.clone()
    if rank == size - 1:   # its last step, alone: input 2, gradient 2 per weight
        assert grads[True].tolist() == [[2 / size, 2 / size]]
        assert grads[False].tolist() == [[2.0, 2.0]]
    else:   # the first step, everyone: input 1, averaged over all ranks
        assert grads[True].tolist() == grads[False].tolist() == [[1.0, 1.0]]


@pytest.mark.mpi(min_size=2)
def test_ddp_and_zero_in_one_join_match_torch(world, gloo):
    from torch.distributed.algorithms.join import Join as TorchJoin
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    rank = world.Get_rank()
    module = _model(seed=rank)
    ours = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=SMALL_BUCKETS_MB)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                       bucket_cap_mb=SMALL_BUCKETS_MB)
    our_zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.1,
                                       momentum=0.9)
    their_zero = TorchZeRO(theirs.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                           momentum=0.9)
    _train(ours, our_zero, Join([ours, our_zero]), _batches(rank))
    _train(theirs, their_zero, TorchJoin([theirs, their_zero]), _batches(rank))
    _assert_same(ours, theirs)
    _assert_same_on_every_rank(world, ours)


def _error_of(model, optimizer, batches):
    try:
        _train(model, optimizer, model.join(throw_on_early_termination=True), batches)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.mpi(min_size=2)
def test_throw_on_early_termination_raises_on_every_rank_as_torch(world, gloo):
    rank = world.Get_rank()
    module = _model(seed=rank)
    ours = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=SMALL_BUCKETS_MB)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                       bucket_cap_mb=SMALL_BUCKETS_MB)
    errors = [_error_of(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(rank))
              for model in (ours, theirs)]
    expected = ("Rank 0 exhausted all inputs." if rank == 0 else
                "Detected at least one rank that exhausted inputs. Throwing across all ranks.")
    assert errors == [expected, expected]
    _assert_same(ours, theirs)   # three steps everywhere, then the error
    _assert_same_on_every_rank(world, ours, parameters_only=True)   # buffers are local
    # the module trains on after the error, outside a join context
    x, y = _batches(rank)[0]
    F.mse_loss(ours(x), y).backward()


@pytest.mark.mpi(min_size=2)
def test_disabled_join_is_a_no_op(world):
    ddp = DistributedDataParallel(_model(0))
    with ddp.join(enable=False):
        for x, y in _batches(0):   # even inputs
            F.mse_loss(ddp(x), y).backward()
    _assert_same_on_every_rank(world, ddp)
