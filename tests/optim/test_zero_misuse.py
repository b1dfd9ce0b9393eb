"""ZeroRedundancyOptimizer used differently on different ranks: the same clear error on every
rank, promptly (a hang would trip the per-test timeout), and an optimizer still usable after."""
import re

import pytest
import torch

from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

from optimizer_classes import NOT_OPTIMIZER_CLASSES, not_an_optimizer_class


def _params(count=4):
    """Parameters of 3, 4, 5... elements, the same on every rank."""
    return [torch.ones(3 + i, requires_grad=True) for i in range(count)]


def _set_gradients(params, step=0):
    generator = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def _same_error_on_every_rank(world, exc_type, match, call):
    """Run ``call``, expect ``exc_type`` matching ``match`` and return its message, checked to
    be the same on every rank."""
    with pytest.raises(exc_type, match=match) as caught:
        call()
    messages = world.allgather(str(caught.value))
    assert messages == [messages[0]] * world.Get_size()
    return messages[0]


def _differing(world, ranks):
    """The part of the message that names the ranks that differ from rank 0."""
    return re.escape(f"ranks {ranks} differ from rank 0")


def _assert_same_on_every_rank(world, params):
    values = world.allgather([p.detach().clone() for p in params])
    for other in values[1:]:
        for p, q in zip(values[0], other):
            assert torch.equal(p, q)


# -- consolidate_state_dict(to=...) ------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_consolidate_to_differing_ranks(world):
    rank, size = world.Get_rank(), world.Get_size()
    zero = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, lr=0.1, momentum=0.9)
    _set_gradients(zero.params_by_index)
    zero.step()
    odd = [r for r in range(size) if r % 2]
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, odd),
        lambda: zero.consolidate_state_dict(to=rank % 2))
    assert "same target rank" in message
    assert "rank 0 has ('to', 0), rank 1 has ('to', 1)" in message
    # out of range on the last rank only: the same error everywhere, not a hang
    _same_error_on_every_rank(
        world, ValueError, rf"{_differing(world, [size - 1])}.*\('to', {size}\)",
        lambda: zero.consolidate_state_dict(to=size if rank == size - 1 else 0))
    # still usable
    zero.consolidate_state_dict(to=size - 1)
    if rank == size - 1:
        state = zero.state_dict()["state"]
        assert sorted(state) == [0, 1, 2, 3]
        assert torch.equal(state[2]["momentum_buffer"],
                           zero.params_by_index[2].grad)


# -- requires_grad ---------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_requires_grad_differs_at_construction(world):
    rank, size = world.Get_rank(), world.Get_size()
    params = _params()
    params[0].requires_grad_(rank != size - 1)
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1))
    assert ("rank 0 has ('parameter 0', ((3,), 'float32', 'cpu', 'requires_grad=True')), "
            f"rank {size - 1} has ('parameter 0', ((3,), 'float32', 'cpu', "
            "'requires_grad=False'))") in message


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bucket_view", [False, True])
def test_requires_grad_changed_on_some_ranks_only(world, bucket_view):
    """Freezing part way is supported, on every rank at once; on some ranks only it would make
    the shards' sizes differ."""
    rank, size = world.Get_rank(), world.Get_size()
    params, reference = _params(6), _params(6)
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adam,
                                   parameters_as_bucket_view=bucket_view, lr=0.1)
    plain = torch.optim.Adam(reference, lr=0.1)
    for step in range(2):
        for tensors, optimizer in ((params, zero), (reference, plain)):
            _set_gradients(tensors, step)
            optimizer.step()
    frozen = 3
    params[frozen].requires_grad_(rank != size - 1)
    message = _same_error_on_every_rank(world, ValueError, _differing(world, [size - 1]),
                                        zero.step)
    assert "requires_grad must be the same on every rank" in message
    assert (f"rank 0 has ('parameter {frozen}', 'requires_grad=True'), rank {size - 1} has "
            f"('parameter {frozen}', 'requires_grad=False')") in message
    # frozen on every rank: steps, and matches a plain optimizer frozen alike
    params[frozen].requires_grad_(False)
    reference[frozen].requires_grad_(False)
    for step in range(2, 4):
        for tensors, optimizer in ((params, zero), (reference, plain)):
            _set_gradients(tensors, step)
            tensors[frozen].grad = None
            optimizer.step()
    for p, q in zip(params, reference):
        assert torch.equal(p, q)
    _assert_same_on_every_rank(world, params)


@pytest.mark.mpi(min_size=2)
def test_gradient_missing_on_some_ranks_keeps_ranks_in_sync(world):
    """Which parameters have a gradient may differ between ranks: the owner's decides, and the
    sizes of the sync do not depend on it."""
    rank, size = world.Get_rank(), world.Get_size()
    params = _params(2 * size)
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.5)
    _set_gradients(params)
    params[rank].grad = None   # a different parameter on each rank
    zero.step()
    _assert_same_on_every_rank(world, params)
    for index, param in enumerate(params):
        owner = zero.partition.rank_of[index]
        stepped = index != owner
        assert torch.equal(param, torch.ones_like(param) - 0.5 * _expected_gradient(param, index)
                           if stepped else torch.ones_like(param))


def _expected_gradient(param, index):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(3 + i, generator=generator) for i in range(index + 1)]
    return grads[index]


# -- parameter and group counts --------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_parameter_count_differs_at_construction(world):
    rank, size = world.Get_rank(), world.Get_size()
    extra = rank == size - 1
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: ZeroRedundancyOptimizer(_params(5 if extra else 4), torch.optim.SGD, lr=0.1))
    assert f"rank {size - 1} has ('parameter 4', ((7,), 'float32', 'cpu', " in message


@pytest.mark.mpi(min_size=2)
def test_group_count_differs_at_construction(world):
    rank, size = world.Get_rank(), world.Get_size()
    params = _params()
    groups = ([{"params": params[:2]}, {"params": params[2:]}] if rank == size - 1
              else [{"params": params}])
    _same_error_on_every_rank(
        world, ValueError, rf"{_differing(world, [size - 1])}.*'groups'",
        lambda: ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1))
    # with overlap_with_ddp=True two groups are an error on the rank that passes them
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: ZeroRedundancyOptimizer(groups, torch.optim.SGD, overlap_with_ddp=True, lr=0.1))
    assert (f"rank {size - 1} has ('outcome', 'ValueError: ZeroRedundancyOptimizer with "
            "overlap_with_ddp=True supports a single parameter group, got 2')") in message


@pytest.mark.mpi(min_size=2)
def test_empty_parameters_on_one_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    params = [] if rank == size - 1 else _params()
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1))
    assert "empty parameter list" in message


def test_the_same_local_error_on_every_rank_keeps_its_type(world):
    with pytest.raises(TypeError, match="parameter 1 is a int"):
        ZeroRedundancyOptimizer([torch.ones(1, requires_grad=True), 1], torch.optim.SGD, lr=0.1)
    zero = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="can only optimize Tensors"):
        zero.add_param_group({"params": [3]})
    assert len(zero.param_groups) == 1


@pytest.mark.mpi(min_size=2)
def test_add_param_group_differs(world):
    rank, size = world.Get_rank(), world.Get_size()
    last = rank == size - 1
    params = _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: zero.add_param_group({"params": _params(3 if last else 2)}))
    assert f"rank {size - 1} has ('parameter 6', ((5,), 'float32', 'cpu', " in message
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: zero.add_param_group({"params": _params(2), "lr": 0.2 if last else 0.1}))
    assert "('lr', '0.2')" in message
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: zero.add_param_group({"params": [3] if last else _params(2)}))
    assert "TypeError: optimizer can only optimize Tensors" in message
    # nothing was added; a group added alike on every rank works
    assert len(zero.param_groups) == len(zero.optim.param_groups) == 1
    assert len(zero.params_by_index) == 4
    added, reference = _params(2), _params(4) + _params(2)
    zero.add_param_group({"params": added, "lr": 0.2})
    plain = torch.optim.SGD([{"params": reference[:4]}, {"params": reference[4:], "lr": 0.2}],
                            lr=0.1)
    for tensors, optimizer in ((params + added, zero), (reference, plain)):
        _set_gradients(tensors)
        optimizer.step()
    for p, q in zip(params + added, reference):
        assert torch.equal(p, q)
    _assert_same_on_every_rank(world, params + added)


# -- load_state_dict -------------------------------------------------------------------------

def _two_groups_state():
    return {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1},
                                          {"params": [2, 3], "lr": 0.1}]}


def test_load_state_dict_with_another_group_count(world):
    zero = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, lr=0.1)
    message = _same_error_on_every_rank(world, ValueError, "2 parameter groups, the optimizer 1",
                                        lambda: zero.load_state_dict(_two_groups_state()))
    assert "rank" not in message


@pytest.mark.mpi(min_size=2)
def test_load_state_dict_differs_between_ranks(world):
    rank, size = world.Get_rank(), world.Get_size()
    last = rank == size - 1
    params, reference = _params(), _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    for tensors, optimizer in ((params, zero), (reference, plain)):
        _set_gradients(tensors)
        optimizer.step()
    good = plain.state_dict()
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: zero.load_state_dict(_two_groups_state() if last else good))
    assert (f"rank {size - 1} has ('outcome', 'ValueError: loaded state dict has 2 parameter "
            "groups, the optimizer 1')") in message
    other_lr = {**good, "param_groups": [{**good["param_groups"][0], "lr": 0.5}]}
    message = _same_error_on_every_rank(
        world, ValueError, _differing(world, [size - 1]),
        lambda: zero.load_state_dict(other_lr if last else good))
    assert "('lr', '0.5')" in message
    # the same good state on every rank loads, and training goes on like the plain optimizer
    zero.load_state_dict(good)
    for tensors, optimizer in ((params, zero), (reference, plain)):
        _set_gradients(tensors, 1)
        optimizer.step()
    for p, q in zip(params, reference):
        assert torch.equal(p, q)


# -- optimizer_class -------------------------------------------------------------------------

@pytest.mark.parametrize("kind, match", NOT_OPTIMIZER_CLASSES)
def test_optimizer_class_must_be_an_optimizer_subclass(world, kind, match):
    optimizer_class = not_an_optimizer_class(kind)
    with pytest.raises(TypeError, match=rf"ZeroRedundancyOptimizer: optimizer_class must be a "
                                        rf"torch.optim.Optimizer subclass, {match}"):
        ZeroRedundancyOptimizer(_params(), optimizer_class, lr=0.1)
    # checked before any collective: a rank alone gets the error too
    if world.Get_rank() == 0:
        with pytest.raises(TypeError, match="optimizer_class"):
            ZeroRedundancyOptimizer(_params(), optimizer_class, lr=0.1)
