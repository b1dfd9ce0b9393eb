"""Model averaging used wrongly, or across ranks that disagree: PyTorch's semantics for
parameters without gradients, the same clear error on every rank, and clear errors after
``close()`` or for an intercommunicator."""
import re
from collections import OrderedDict

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers, utils
from tensorplay_hpc.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager)
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer


def _model(rank):
    """A Linear(3, 2) holding small integers that depend on the rank, without gradients."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + k)
    return model


def _mean_model(size):
    """The exact mean over ranks of :func:`_model` (integers over 1, 2 or 4 ranks are exact)."""
    models = [_model(r) for r in range(size)]
    return [sum(ps).detach() / size for ps in zip(*(m.parameters() for m in models))]


def _same_error_on_every_rank(world, exc_type, match, call):
    with pytest.raises(exc_type, match=match) as caught:
        call()
    messages = world.allgather(str(caught.value))
    assert messages == [messages[0]] * world.Get_size()
    return messages[0]


# -- parameters without gradients ---------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_average_parameters_averages_parameters_without_gradients(world, gloo):
    from torch.distributed.algorithms.model_averaging import utils as torch_utils
    rank, size = world.Get_rank(), world.Get_size()
    ours, theirs = _model(rank), _model(rank)
    assert all(p.grad is None for p in ours.parameters())
    utils.average_parameters(ours.parameters(), None)
    torch_utils.average_parameters(theirs.parameters(), None)
    for p, q, expected in zip(ours.parameters(), theirs.parameters(), _mean_model(size)):
        assert torch.equal(p.detach(), expected)
        assert torch.equal(q.detach(), expected)


@pytest.mark.mpi(min_size=2)
def test_only_the_filtering_functions_skip_parameters_without_gradients(world):
    rank, size = world.Get_rank(), world.Get_size()
    model = _model(rank)
    model.weight.grad = torch.zeros_like(model.weight)   # the bias has no gradient
    expected_weight, expected_bias = _mean_model(size)
    own_bias = model.bias.detach().clone()
    averager = averagers.PeriodicModelAverager(period=2)
    averager.average_parameters(model.parameters())
    assert torch.equal(model.weight.detach(), expected_weight)
    assert torch.equal(model.bias.detach(), own_bias)
    utils.average_parameters(model.parameters(), None)
    assert torch.equal(model.bias.detach(), expected_bias)
    averager.close()


# -- a gradient on some ranks only ------------------------------------------------------------

def _params_with_gradients():
    params = [torch.nn.Parameter(torch.full((3 + i,), float(i))) for i in range(3)]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["function", "param groups", "periodic", "hierarchical"])
def test_gradient_missing_on_one_rank(world, how):
    rank, size = world.Get_rank(), world.Get_size()
    params = _params_with_gradients()
    if rank == size - 1:
        params[1].grad = None
    average = {
        "function": lambda: utils.average_parameters_or_parameter_groups(params, world),
        "param groups": lambda: utils.average_parameters_or_parameter_groups(
            [{"params": params[:1]}, {"params": params[1:]}], None),
        "periodic": averagers.PeriodicModelAverager(period=2).average_parameters,
        "hierarchical": HierarchicalModelAverager(OrderedDict([(2, size)])).average_parameters,
    }[how]
    call = average if how in ("function", "param groups") else lambda: average(params)
    label = "param group 1, parameter 0" if how == "param groups" else "parameter 1"
    message = _same_error_on_every_rank(world, ValueError, re.escape(
        f"model averaging needs a gradient on the same parameters, of the same shapes and "
        f"dtypes, on every rank: ranks [{size - 1}] differ from rank 0"), call)
    assert (f"rank 0 has ('{label}', ((4,), 'float32', 'cpu')), rank {size - 1} has "
            f"('{label}', 'no gradient')") in message
    # still usable once the gradients agree
    params[1].grad = torch.zeros_like(params[1])
    for p in params:
        p.data.fill_(rank)
    call()
    assert all(torch.equal(p.detach(), torch.full_like(p, (size - 1) / 2)) for p in params)


@pytest.mark.mpi(min_size=4)
def test_gradient_missing_in_one_hierarchical_subgroup(world):
    rank, size = world.Get_rank(), world.Get_size()
    averager = HierarchicalModelAverager(OrderedDict([(1, 2), (2, size)]), warmup_steps=1)
    members = averager.period_process_group_dict[1].allgather(rank)   # this rank's pair
    params = _params_with_gradients()
    averager.average_parameters(params)   # step 0: warm-up
    if rank == size - 1:
        params[2].grad = None
    if size - 1 in members:   # step 1: the pair holding the last rank fails, alike on both
        message = _same_error_on_every_rank(
            averager.period_process_group_dict[1], ValueError,
            re.escape(f"of the group averaging every 1 steps (process-group ranks {members}, "
                      f"ranked 0 to 1 below): ranks [{members.index(size - 1)}] differ"),
            lambda: averager.average_parameters(params))
        assert "('parameter 2', 'no gradient')" in message
    else:                     # the other pairs average
        averager.average_parameters(params)
    averager.close()


# -- use after close() ------------------------------------------------------------------------

def test_process_group_closed(world):
    group = comm.ProcessGroup(world)
    group.close()
    with pytest.raises(RuntimeError, match="ProcessGroup is closed"):
        comm.all_reduce(torch.ones(2), group.comm)
    group.close()   # closing again does nothing
    assert group.closed and "closed" in repr(group)


@pytest.mark.parametrize("make", [
    lambda size: averagers.PeriodicModelAverager(period=2),
    lambda size: HierarchicalModelAverager(OrderedDict([(2, size)])),
], ids=["PeriodicModelAverager", "HierarchicalModelAverager"])
def test_averager_closed(world, make):
    rank = world.Get_rank()
    averager = make(world.Get_size())
    p = torch.nn.Parameter(torch.full((3,), float(rank)))
    p.grad = torch.zeros_like(p)
    averager.close()
    averager.close()
    with pytest.raises(RuntimeError, match=f"{type(averager).__name__} is closed"):
        averager.average_parameters([p])
    assert torch.equal(p.detach(), torch.full((3,), float(rank)))
    assert averager.step == 0


# -- an intercommunicator as process group ----------------------------------------------------

INTERCOMM = re.escape("process_group must be an mpi4py intracommunicator (MPI.Intracomm) or "
                      "None, got an MPI.Intercomm")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["ProcessGroup", "average_parameters",
                                 "average_parameters_or_parameter_groups", "periodic",
                                 "hierarchical", "ZeroRedundancyOptimizer"])
def test_intercommunicator_is_refused_on_every_rank(world, how):
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split(rank % 2, rank)
    inter = local.Create_intercomm(0, world, 1 - rank % 2, 12)
    params = _params_with_gradients()
    build = {
        "ProcessGroup": lambda: comm.ProcessGroup(inter),
        "average_parameters": lambda: utils.average_parameters(params, inter),
        "average_parameters_or_parameter_groups":
            lambda: utils.average_parameters_or_parameter_groups(params, inter),
        "periodic": lambda: averagers.PeriodicModelAverager(period=2, process_group=inter),
        "hierarchical": lambda: HierarchicalModelAverager(OrderedDict([(2, size)]),
                                                          process_group=inter),
        "ZeroRedundancyOptimizer": lambda: ZeroRedundancyOptimizer(
            params, torch.optim.SGD, process_group=inter, lr=0.1),
    }[how]
    message = _same_error_on_every_rank(world, TypeError, INTERCOMM, build)
    assert "Intercomm.Merge()" in message
    inter.Free()
    local.Free()
