"""PostLocalSGDOptimizer: a local step then averaging, and its checkpointed step counter."""
import copy
from collections import OrderedDict

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc.distributed.algorithms.model_averaging import averagers, utils
from tensorplay_hpc.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager)
from tensorplay_hpc.distributed.optim import PostLocalSGDOptimizer

pytestmark = pytest.mark.scale   # averaging subgroups: again at 8 ranks on 4 nodes
STEPS = 20


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _train(model, optimizer, rank, after_step):
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x, y = torch.randn(6, 4, generator=generator), torch.randn(6, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        after_step(step)


def _check_against_manual(world, make_averager, group_for_step):
    """Train with PostLocalSGDOptimizer and with SGD plus explicit ``average_parameters``."""
    rank = world.Get_rank()
    ours_model, manual_model = _model(), _model()
    ours = PostLocalSGDOptimizer(torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9),
                                 make_averager())
    _train(ours_model, ours, rank, lambda step: None)
    manual = torch.optim.SGD(manual_model.parameters(), lr=0.05, momentum=0.9)

    def average(step):
        group = group_for_step(step)
        if group is not None:
            utils.average_parameters(manual_model.parameters(), group)
    _train(manual_model, manual, rank, average)
    for a, b in zip(ours_model.parameters(), manual_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ours.averager.step == STEPS
    return ours, ours_model


def test_periodic_equals_local_step_then_average(world):
    _check_against_manual(
        world, lambda: averagers.PeriodicModelAverager(period=3, warmup_steps=5),
        lambda step: MPI.COMM_WORLD if step >= 5 and (step - 5) % 3 == 0 else None)


def test_hierarchical_equals_local_step_then_average(world):
    rank, size = world.Get_rank(), world.Get_size()
    half = max(size // 2, 1)
    # The averager's groups of ``half`` ranks: consecutive ranks, unless the nodes are not
    # consecutive (``--map-by node``), where they are the nodes.
    hosts = world.allgather(MPI.Get_processor_name())
    consecutive = hosts == sorted(hosts, key=hosts.index)
    assert consecutive or hosts.count(hosts[rank]) == half
    pairs = world.Split(rank // half if consecutive else hosts.index(hosts[rank]), rank)

    def group_for_step(step):
        if step < 6:
            return None
        if step % 4 == 0:
            return MPI.COMM_WORLD
        return pairs if step % 2 == 0 else None
    _check_against_manual(
        world, lambda: HierarchicalModelAverager(OrderedDict([(2, half), (4, size)]), 6),
        group_for_step)
    pairs.Free()


def test_state_dict_round_trip_and_missing_step(world):
    optimizer, model = _check_against_manual(
        world, lambda: averagers.PeriodicModelAverager(period=4, warmup_steps=2),
        lambda step: MPI.COMM_WORLD if step >= 2 and (step - 2) % 4 == 0 else None)
    saved = optimizer.state_dict()
    assert saved["step"] == STEPS
    assert set(saved) == {"state", "param_groups", "step"}
    # The inner state is a plain SGD state dict: it loads into torch.optim.SGD.
    plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plain.load_state_dict({k: v for k, v in saved.items() if k != "step"})
    torch.testing.assert_close(plain.state[model[0].weight]["momentum_buffer"],
                               optimizer.state[model[0].weight]["momentum_buffer"])

    restored = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     averagers.PeriodicModelAverager(period=4, warmup_steps=2))
    before = copy.deepcopy(saved)
    restored.load_state_dict(saved)
    assert restored.averager.step == STEPS
    assert saved.keys() == before.keys() and saved["step"] == before["step"]
    torch.testing.assert_close(restored.state[model[2].bias]["momentum_buffer"],
                               optimizer.state[model[2].bias]["momentum_buffer"])
    assert restored.param_groups[0]["lr"] == 0.05

    del saved["step"]
    with pytest.warns(UserWarning, match="Loaded state dict does not contain a step counter for "
                                         "an averager. Setting step counter to 0."):
        restored.load_state_dict(saved)
    assert restored.averager.step == 0


def test_delegates_to_local_optimizer(world):
    model = _model()
    local = torch.optim.SGD(model[0].parameters(), lr=0.1)
    optimizer = PostLocalSGDOptimizer(local, averagers.PeriodicModelAverager(period=2))
    assert isinstance(optimizer, torch.optim.Optimizer)
    optimizer.add_param_group({"params": model[2].parameters(), "lr": 0.2})
    assert optimizer.param_groups is local.param_groups and len(optimizer.param_groups) == 2
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert optimizer.averager.step == 1
    assert optimizer.state is local.state
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
