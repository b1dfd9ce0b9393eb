"""Model averagers: schedules, groups, inputs, and parity with PyTorch's over gloo."""
from collections import OrderedDict

import pytest
import torch
from launch import mpiexec, only_in_single_rank_run
from mpi4py import MPI

from tensorplay_hpc.distributed.algorithms.model_averaging import averagers, utils
from tensorplay_hpc.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager)

pytestmark = pytest.mark.scale   # averaging groups and subgroups: again at 8 ranks on 4 nodes


def _param(value, dtype=torch.float32, grad=True):
    p = torch.nn.Parameter(torch.full((3,), float(value), dtype=dtype))
    if grad:
        p.grad = torch.zeros_like(p)
    return p


def _averaged_steps(averager, world, steps=20):
    """The steps at which ``averager`` averaged a parameter reset to the world rank each step."""
    rank = world.Get_rank()
    p = _param(rank)
    averaged = {}
    for step in range(steps):
        p.data.fill_(rank)
        averager.average_parameters([p])
        if p[0].item() != rank:
            averaged[step] = p[0].item()
            torch.testing.assert_close(p.data, torch.full((3,), p[0].item()))
    return averaged


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("warmup, expected", [(12, [12, 16]), (13, [13, 17]), (14, [14, 18]),
                                              (15, [15, 19])])
def test_periodic_schedule(world, warmup, expected):
    averager = averagers.PeriodicModelAverager(period=4, warmup_steps=warmup)
    averaged = _averaged_steps(averager, world)
    mean = (world.Get_size() - 1) / 2
    assert averaged == {step: mean for step in expected}
    assert averager.step == 20


def test_periodic_arguments(world):
    with pytest.raises(ValueError, match="period"):
        averagers.PeriodicModelAverager(period=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        averagers.PeriodicModelAverager(period=2, warmup_steps=-1)
    with pytest.warns(UserWarning, match="period of 1"):
        averagers.PeriodicModelAverager(period=1)
    with pytest.raises(TypeError):
        averagers.ModelAverager()


def test_param_groups_mixed_dtypes_only_with_grad(world):
    rank, size = world.Get_rank(), world.Get_size()
    a, b = _param(rank), _param(2 * rank, torch.float64)
    c = _param(rank, grad=False)                     # no gradient: not averaged
    d = _param(10 * rank, torch.bfloat16)
    groups = [{"params": [a, b], "lr": 0.1}, {"params": [c, d]}]
    assert utils.get_params_to_average(groups) == [a, b, d]
    utils.average_parameters_or_parameter_groups(groups, None)
    mean = (size - 1) / 2
    torch.testing.assert_close(a.data, torch.full((3,), mean))
    torch.testing.assert_close(b.data, torch.full((3,), 2 * mean, dtype=torch.float64))
    torch.testing.assert_close(c.data, torch.full((3,), float(rank)))
    torch.testing.assert_close(d.data, torch.full((3,), 10 * mean, dtype=torch.bfloat16))
    utils.average_parameters_or_parameter_groups([a], MPI.COMM_WORLD)
    torch.testing.assert_close(a.data, torch.full((3,), mean))
    with pytest.raises(NotImplementedError, match="param-group dicts"):
        utils.average_parameters_or_parameter_groups([3.0], None)
    with pytest.raises(TypeError, match="average_parameters_or_parameter_groups"):
        utils.average_parameters(groups, None)   # PyTorch's takes parameters only


@pytest.mark.mpi(min_size=2)
def test_subgroup_averages_others_keep_values(world):
    rank = world.Get_rank()
    sub = world.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    p = _param(rank)
    for _ in range(2):   # the private duplicate is cached: the second call reuses it
        utils.average_parameters([p], sub)
    torch.testing.assert_close(p.data, torch.full((3,), 0.5 if rank < 2 else float(rank)))
    averager = averagers.PeriodicModelAverager(period=2, process_group=sub)
    q = _param(rank)
    averager.average_parameters([q])
    torch.testing.assert_close(q.data, torch.full((3,), 0.5 if rank < 2 else float(rank)))
    assert averager.step == 1
    averager.close()
    if sub != MPI.COMM_NULL:
        sub.Free()


def _node_pattern(communicator):
    """Each rank's node as the index of its first appearance, from the processor names (the
    hosts): ``(0, 0, 1, 1)`` for nodes of consecutive ranks, ``(0, 1, 0, 1)`` for
    ``--map-by node``."""
    hosts = communicator.allgather(MPI.Get_processor_name())
    return tuple(list(dict.fromkeys(hosts)).index(host) for host in hosts)


def _members(communicator):
    """The world ranks of ``communicator``, in its rank order."""
    return list(communicator.Get_group().Translate_ranks(
        list(range(communicator.Get_size())), MPI.COMM_WORLD.Get_group()))


# World ranks interleaved, so that on two nodes of consecutive ranks the group's nodes are not.
INTERLEAVED = [0, 2, 1, 3]

# The level of 2 ranks under HierarchicalModelAverager(OrderedDict([(2, 2), (4, 4)])), in world
# ranks, for each node layout of the world and order of the group's ranks: blocks of consecutive
# group ranks where the nodes are consecutive in the group, else the nodes themselves.
PAIRS = {
    ((0, 0, 0, 0), "world"): [[0, 1], [2, 3]],
    ((0, 0, 0, 0), "interleaved"): [[0, 2], [1, 3]],
    ((0, 0, 1, 1), "world"): [[0, 1], [2, 3]],
    ((0, 0, 1, 1), "interleaved"): [[0, 1], [2, 3]],
    ((0, 1, 0, 1), "world"): [[0, 2], [1, 3]],
    ((0, 1, 0, 1), "interleaved"): [[0, 2], [1, 3]],
}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("order", ["world", "interleaved"])
def test_hierarchical_schedule_and_groups_follow_nodes(world, order):
    if world.Get_size() != 4:
        pytest.skip("the layouts below are written for 4 ranks")
    rank = world.Get_rank()
    group = world if order == "world" else world.Split(0, INTERLEAVED.index(rank))
    layout = _node_pattern(world)
    if (layout, order) not in PAIRS:
        pytest.skip(f"no expectation written for the node layout {layout}")
    averager = HierarchicalModelAverager(OrderedDict([(2, 2), (4, 4)]), warmup_steps=1,
                                         process_group=group)
    pair = next(p for p in PAIRS[layout, order] if rank in p)
    assert sorted(_members(averager.period_process_group_dict[2])) == pair
    assert averager.period_process_group_dict[4].Get_size() == 4
    # Parameters 10**rank: a pair averages to exactly (10**a + 10**b) / 2, the world to 277.75.
    pair_mean = {(0, 1): 5.5, (2, 3): 550.0, (0, 2): 50.5, (1, 3): 505.0}[tuple(pair)]
    p = _param(0, torch.float64)
    seen = {}
    for step in range(7):
        p.data.fill_(10.0 ** rank)
        averager.average_parameters([p])
        seen[step] = p[0].item()
    own = 10.0 ** rank
    assert seen == {0: own, 1: own, 2: pair_mean, 3: own, 4: 277.75, 5: own, 6: pair_mean}
    averager.close()
    if group is not world:
        group.Free()


@pytest.mark.mpi(min_size=6)
def test_hierarchical_six_ranks_by_node(world):
    """Run by :func:`test_hierarchical_layouts_across_nodes`: 6 ranks, ``--map-by node`` on 2
    nodes, so node n1 holds ranks 0, 2, 4 and node n2 ranks 1, 3, 5."""
    if world.Get_size() != 6 or _node_pattern(world) != (0, 1, 0, 1, 0, 1):
        pytest.skip("written for 6 ranks placed by node on 2 nodes")
    rank = world.Get_rank()
    averager = HierarchicalModelAverager(OrderedDict([(2, 3), (4, 6)]))
    node = [0, 2, 4] if rank % 2 == 0 else [1, 3, 5]
    assert _members(averager.period_process_group_dict[2]) == node
    p = _param(0, torch.float64)
    seen = {}
    for step in range(5):
        p.data.fill_(10.0 ** rank)
        averager.average_parameters([p])
        seen[step] = p[0].item()
    node_mean = 10101.0 / 3 if rank % 2 == 0 else 101010.0 / 3
    own = 10.0 ** rank
    assert seen == {0: 111111.0 / 6, 1: own, 2: node_mean, 3: own, 4: 111111.0 / 6}
    averager.close()
    # Pairs can neither split nor join nodes of 3 ranks spread over the ranks: every rank refuses.
    with pytest.raises(ValueError, match=r"Groups of 2 ranks cannot follow nodes of 3 ranks whose "
                                         r"ranks are not consecutive \(nodes \[\[0, 2, 4\], "
                                         r"\[1, 3, 5\]\]\)"):
        HierarchicalModelAverager(OrderedDict([(2, 2), (4, 6)]))
    # World ranks 0, 1, 2, 4: nodes of 3 and 1 ranks, not consecutive in the group.
    members = [0, 1, 2, 4]
    group = world.Split(0 if rank in members else MPI.UNDEFINED, rank)
    if rank in members:
        with pytest.raises(ValueError, match=r"Groups of 2 ranks cannot follow nodes of "
                                             r"different sizes .*\[\[0, 2, 3\], \[1\]\]"):
            HierarchicalModelAverager(OrderedDict([(2, 2), (4, 4)]), process_group=group)
        one_level = HierarchicalModelAverager({2: 4}, process_group=group)
        q = _param(0, torch.float64)
        q.data.fill_(10.0 ** rank)
        one_level.average_parameters([q])
        assert q[0].item() == 10111.0 / 4
        one_level.close()
        group.Free()


@only_in_single_rank_run
def test_hierarchical_layouts_across_nodes(simulated_nodes):
    result = mpiexec(6, ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                         f"{__file__}::test_hierarchical_six_ranks_by_node"],
                     nodes=simulated_nodes, flags=["--map-by", "node"], timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout, result.stdout


@pytest.mark.mpi(min_size=2)
def test_hierarchical_one_level_equals_periodic(world):
    size = world.Get_size()
    hierarchical = HierarchicalModelAverager({4: size}, warmup_steps=8)
    periodic = averagers.PeriodicModelAverager(4, warmup_steps=8)
    assert _averaged_steps(hierarchical, world) == _averaged_steps(periodic, world)
    assert hierarchical.step == periodic.step == 20
    assert sorted(_averaged_steps(averagers.PeriodicModelAverager(4, 8), world)) == [8, 12, 16]
    assert sorted(_averaged_steps(HierarchicalModelAverager({4: size}), world)) == [0, 4, 8, 12, 16]
    # Like PyTorch: the hierarchical test is step % period, not (step - warmup) % period.
    assert sorted(_averaged_steps(HierarchicalModelAverager({4: size}, 10), world)) == [12, 16]
    assert sorted(_averaged_steps(averagers.PeriodicModelAverager(4, 10), world)) == [10, 14, 18]


def test_hierarchical_arguments(world):
    size = world.Get_size()
    with pytest.raises(ValueError, match="must not be empty"):
        HierarchicalModelAverager(OrderedDict())
    with pytest.raises(ValueError, match="must be positive"):
        HierarchicalModelAverager(OrderedDict([(0, 1), (4, size)]))
    with pytest.raises(ValueError, match="last value"):
        HierarchicalModelAverager(OrderedDict([(2, size + 1)]))
    with pytest.raises(ValueError, match="warmup_steps"):
        HierarchicalModelAverager({2: size}, warmup_steps=-1)
    with pytest.warns(UserWarning, match="period of 1"):
        HierarchicalModelAverager({1: size})
    if size == 4:
        with pytest.raises(ValueError, match="divide"):
            HierarchicalModelAverager(OrderedDict([(2, 3), (4, 4)]))


def _torch_and_ours(world, gloo, make_torch, make_ours, steps=12):
    """Local SGD on per-rank data, averaged by PyTorch's averager and by ours."""
    rank = world.Get_rank()
    models = []
    for make in (make_torch, make_ours):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        averager = make()
        for _ in range(steps):
            x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            averager.average_parameters(model.parameters())
        models.append(model)
    for theirs, ours in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(ours, theirs)
    return models


@pytest.mark.mpi(min_size=2)
def test_periodic_matches_torch(world, gloo):
    from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
    torch_model, _ = _torch_and_ours(
        world, gloo, lambda: torch_averagers.PeriodicModelAverager(period=3, warmup_steps=2),
        lambda: averagers.PeriodicModelAverager(period=3, warmup_steps=2))
    # The last averaging was at step 11: every rank holds the same model.
    first = torch_model[0].weight.detach()
    gathered = world.allgather(first.clone())
    torch.testing.assert_close(gathered[0], gathered[-1])


@pytest.mark.mpi(min_size=2)
def test_hierarchical_matches_torch(world, gloo):
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager as TorchHierarchical)
    layout = _node_pattern(world)
    if list(layout) != sorted(layout):
        pytest.skip("PyTorch's subgroups are blocks of consecutive ranks, ours follow the nodes, "
                    "which are not consecutive here")
    size = world.Get_size()
    levels = OrderedDict([(2, size // 2), (3, size)])
    _torch_and_ours(world, gloo, lambda: TorchHierarchical(levels, warmup_steps=3),
                    lambda: HierarchicalModelAverager(levels, warmup_steps=3))


def test_averager_keeps_its_buffer_function_keeps_storage(world):
    rank, size = world.Get_rank(), world.Get_size()
    mean = (size - 1) / 2
    a, b = _param(rank), _param(rank)
    before = a.data_ptr()
    utils.average_parameters([a, b], None)
    assert a.data_ptr() == before   # the function copies the averages back
    averager = averagers.PeriodicModelAverager(period=2)
    for step in range(4):   # steps 0 and 2 average
        a.data.fill_(rank)
        b.data.fill_(rank + 1)
        averager.average_parameters([a, b])
        averaged = step % 2 == 0
        torch.testing.assert_close(a.data, torch.full((3,), mean if averaged else float(rank)))
        torch.testing.assert_close(b.data, torch.full((3,), mean + 1 if averaged else rank + 1.0))
    # The averager re-pointed the parameters into its flat buffer (as PyTorch does): later
    # averagings reduce that buffer in place.
    assert b.data_ptr() - a.data_ptr() == 3 * a.element_size()
