"""ZeroRedundancyOptimizer: values, parity with a plain optimizer and with PyTorch's class."""
import copy
from itertools import chain

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from joinables import CPUJoinable
from tensorplay_hpc.distributed.algorithms.join import Join, JoinHook
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]


def _model(dtypes=(torch.float32,) * 3, seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)]
    for layer, dtype in zip(layers, dtypes):
        layer.to(dtype)
    return torch.nn.Sequential(*layers)


def _twin(model):
    return copy.deepcopy(model)


def _backward(model, step):
    """The same gradients on every rank: the data depends on the step only."""
    data = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    out = data
    for layer in model:
        out = layer(out.to(layer.weight.dtype))
    out.float().sin().sum().backward()  # bounded, so maximizing stays finite


def _train(pairs, steps, first_step=0, freeze_at=None, unfreeze_at=None):
    """Step each (model, optimizer) pair alike; the first layer's weight is frozen from step
    ``freeze_at`` to step ``unfreeze_at``."""
    for step in range(first_step, first_step + steps):
        for model, optimizer in pairs:
            if step in (freeze_at, unfreeze_at):
                model[0].weight.requires_grad_(step == unfreeze_at)
            optimizer.zero_grad()
            _backward(model, step)
            optimizer.step()


def _assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def _assert_same_state_dict(ours, theirs):
    assert ours["param_groups"] == theirs["param_groups"]
    assert list(ours["state"]) == list(theirs["state"])
    for index, state in theirs["state"].items():
        assert list(ours["state"][index]) == list(state)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert ours["state"][index][key].dtype == value.dtype
                assert torch.equal(ours["state"][index][key], value), (index, key)
            else:
                assert ours["state"][index][key] == value


def _consolidated(optimizer, world, to=0):
    """The consolidated state dict, sent from rank ``to`` to every rank (test plumbing)."""
    optimizer.consolidate_state_dict(to=to)
    state_dict = optimizer.state_dict() if world.Get_rank() == to else None
    return world.bcast(state_dict, root=to)


# -- construction ----------------------------------------------------------------------------

def test_constructor_validation():
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match="single"):
        ZeroRedundancyOptimizer(x, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="parameter 1 is a int"):
        ZeroRedundancyOptimizer([x, 1], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="iterable"):
        ZeroRedundancyOptimizer(3, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="'params'"):
        ZeroRedundancyOptimizer([{"lr": 0.1}], torch.optim.SGD, lr=0.1)
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True).requires_grad_()
    with pytest.raises(ValueError, match="dense"):
        ZeroRedundancyOptimizer([x, sparse], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="single parameter group"):
        ZeroRedundancyOptimizer([{"params": [x]}, {"params": [torch.ones(1)]}], torch.optim.SGD,
                                overlap_with_ddp=True, lr=0.1)

    model = _model()
    from_generator = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    assert isinstance(from_generator, torch.optim.Optimizer)
    assert len(from_generator.param_groups[0]["params"]) == 6
    mixed = ZeroRedundancyOptimizer([x, torch.ones(2, dtype=torch.bfloat16, requires_grad=True)],
                                    torch.optim.SGD, lr=0.1)
    assert [p.dtype for p in mixed.param_groups[0]["params"]] == [torch.float32, torch.bfloat16]


def test_outside_the_group_is_an_error(world):
    rank = world.Get_rank()
    even = world.Split(0 if rank % 2 == 0 else MPI.UNDEFINED, rank)
    if even == MPI.COMM_NULL:
        with pytest.raises(ValueError, match="not a member"):
            ZeroRedundancyOptimizer([torch.ones(1, requires_grad=True)], torch.optim.SGD,
                                    process_group=even, lr=0.1)
    else:
        even.Free()


# -- exact values ----------------------------------------------------------------------------

def test_sgd_momentum_values_and_reload(world):
    x = torch.tensor([1.0], requires_grad=True)
    zero = ZeroRedundancyOptimizer([x], torch.optim.SGD, lr=0.1, momentum=0.9)
    x.grad = torch.ones(1)
    zero.step()
    assert x.item() == pytest.approx(0.9, abs=1e-7)
    state_dict = _consolidated(zero, world)
    assert state_dict["param_groups"][0]["lr"] == 0.1
    assert state_dict["param_groups"][0]["params"] == [0]
    assert torch.equal(state_dict["state"][0]["momentum_buffer"], torch.ones(1))

    fresh = ZeroRedundancyOptimizer([x], torch.optim.SGD, lr=0.01, momentum=0.9)
    fresh.load_state_dict(state_dict)
    assert fresh.param_groups[0]["lr"] == 0.1
    assert fresh.optim.param_groups[0]["lr"] == 0.1
    fresh.step()
    assert x.item() == pytest.approx(0.71, abs=1e-6)
    again = _consolidated(fresh, world)
    assert again["state"][0]["momentum_buffer"].item() == pytest.approx(1.9, abs=1e-6)
    # the loaded dict is untouched
    assert torch.equal(state_dict["state"][0]["momentum_buffer"], torch.ones(1))


def test_state_dict_needs_consolidation(world):
    rank, size = world.Get_rank(), world.Get_size()
    zero = ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=rf"consolidate_state_dict\(to={rank}\)"):
        zero.state_dict()
    target = size - 1
    zero.consolidate_state_dict(to=target)
    if rank == target:
        assert zero.state_dict()["param_groups"][0]["params"] == list(range(6))
    else:
        with pytest.raises(RuntimeError, match="has not been consolidated"):
            zero.state_dict()
    with pytest.raises(ValueError, match="not a rank"):
        zero.consolidate_state_dict(to=size)


def test_closure_loss_and_step_keywords():
    class ScaledSGD(torch.optim.SGD):
        def step(self, closure=None, scale=1.0):
            with torch.enable_grad():
                loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(scale)
            super().step()
            return loss

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    zero = ZeroRedundancyOptimizer([x], ScaledSGD, lr=0.5)

    def closure():
        zero.zero_grad()
        loss = x.sum()
        loss.backward()
        return loss

    loss = zero.step(closure, scale=2.0)
    assert loss.item() == 3.0
    assert x.tolist() == [0.0, 1.0]


# -- partition -------------------------------------------------------------------------------

def _sized_params(sizes):
    return [torch.zeros(n, requires_grad=True) for n in sizes]


def _local_numel(zero):
    return sum(p.numel() for g in zero.optim.param_groups for p in g["params"])


@pytest.mark.parametrize("bucket_view", [False, True])
def test_sharding_is_balanced(world, bucket_view):
    size = world.Get_size()
    params, reference = _sized_params([9, 7, 5, 3] * size), _sized_params([9, 7, 5, 3] * size)
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD,
                                   parameters_as_bucket_view=bucket_view, lr=0.1)
    assert zero.partition.loads == [24] * size
    assert _local_numel(zero) == 24
    added, added_reference = _sized_params([9, 7, 5, 3] * size), _sized_params([9, 7, 5, 3] * size)
    zero.add_param_group({"params": added, "lr": 0.2})
    assert zero.partition.loads == [48] * size
    assert _local_numel(zero) == 48
    assert [g["lr"] for g in zero.optim.param_groups] == [0.1, 0.2]
    assert len(zero.partition.rank_of) == 8 * size
    # the new parameters are stepped by their owners and reach every rank
    plain = torch.optim.SGD([{"params": reference}, {"params": added_reference, "lr": 0.2}],
                            lr=0.1)
    for step in range(2):
        for tensors, optimizer in ((params + added, zero), (reference + added_reference, plain)):
            generator = torch.Generator().manual_seed(step)
            for p in tensors:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
    for p, q in zip(params + added, reference + added_reference):
        assert torch.equal(p, q)


@pytest.mark.scale   # more ranks than parameters at 8
def test_multiple_groups(world):
    rank, size = world.Get_rank(), world.Get_size()
    model, reference = _model(), _model()
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.02},  # noqa: E731
                        {"params": list(m[1].parameters()) + list(m[2].parameters())}]
    zero = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(groups(reference), lr=0.01)
    assert len(zero.optim.param_groups) == 2
    assert [g["lr"] for g in zero.optim.param_groups] == [0.02, 0.01]
    # sorted-greedy: group 0 holds sizes 32, 8; group 1 holds 48, 6, 18, 3 (taken 48, 18, 6, 3)
    expected_rank_of = {1: [0, 0, 0, 0, 0, 0], 2: [0, 1, 1, 0, 0, 0], 4: [0, 1, 2, 1, 3, 1]}
    if size in expected_rank_of:
        assert zero.partition.rank_of == expected_rank_of[size]
    assert all(0 <= r < size for r in zero.partition.rank_of)
    owned = [zero.params_by_index[i] for g in zero.partition.owned(rank) for i in g]
    assert [p for g in zero.optim.param_groups for p in g["params"]] == owned
    _train([(model, zero), (reference, plain)], 6)
    _assert_same_params(model, reference)


# -- parity with a plain local optimizer --------------------------------------------------

@pytest.mark.scale   # more ranks than parameters at 8
@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("optimizer_class,kwargs", OPTIMIZERS)
def test_parity_with_local_optimizer(optimizer_class, kwargs, maximize, bucket_view):
    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class,
                                   parameters_as_bucket_view=bucket_view, maximize=maximize,
                                   **kwargs)
    plain = optimizer_class(reference.parameters(), maximize=maximize, **kwargs)
    _train([(model, zero), (reference, plain)], 14, freeze_at=7, unfreeze_at=11)
    _assert_same_params(model, reference)
    _train([(model, zero), (reference, plain)], 6, first_step=14, freeze_at=16)
    _assert_same_params(model, reference)
    assert not model[0].weight.requires_grad
    # keys the local optimizer adds show on the wrapper
    assert zero.param_groups[0]["maximize"] is maximize
    assert set(zero.param_groups[0]) == set(plain.param_groups[0])


def test_lr_scheduler_on_the_wrapper():
    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (zero, plain)]
    for step in range(6):
        _train([(model, zero), (reference, plain)], 1, first_step=step)
        for scheduler in schedulers:
            scheduler.step()
    assert zero.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.0125
    zero.step()  # hands the scheduled rate to the local optimizer
    assert zero.optim.param_groups[0]["lr"] == 0.0125
    assert zero.param_groups[0]["initial_lr"] == 0.1


@pytest.mark.parametrize("bucket_view", [False, True])
def test_state_dicts_cross_load_with_local_optimizer(world, bucket_view):
    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                   parameters_as_bucket_view=bucket_view, lr=0.01)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    _train([(model, zero), (reference, plain)], 5)
    ours = _consolidated(zero, world)
    _assert_same_state_dict(ours, plain.state_dict())

    # swap: ZeRO continues from the plain optimizer's state and the plain one from ZeRO's
    zero_again = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                         parameters_as_bucket_view=bucket_view, lr=0.5)
    zero_again.load_state_dict(plain.state_dict())
    plain_again = torch.optim.Adam(reference.parameters(), lr=0.5)
    plain_again.load_state_dict(ours)
    _train([(model, zero_again), (reference, plain_again)], 5, first_step=5)
    _assert_same_params(model, reference)
    _assert_same_state_dict(_consolidated(zero_again, world), plain_again.state_dict())


def test_state_shows_this_ranks_shard(world):
    rank = world.Get_rank()
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    _train([(model, zero)], 1)
    for index, param in enumerate(zero.params_by_index):
        if zero.partition.rank_of[index] == rank:
            assert param in zero.state
            assert set(zero.state[param]) == {"step", "exp_avg", "exp_avg_sq"}
        else:
            assert param not in zero.state
            assert zero.state[param] == {}
    assert set(zero.local_state_by_index()) == {
        i for i, r in enumerate(zero.partition.rank_of) if r == rank}


# -- parity with PyTorch's ZeroRedundancyOptimizer over gloo -----------------------------

@pytest.mark.scale
@pytest.mark.parametrize("bucket_view", [False, True])
def test_parity_with_pytorch_zero(world, gloo, bucket_view):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    rank = world.Get_rank()
    sizes = [9, 7, 5, 3, 11, 2] * world.Get_size()
    ours_params, theirs_params = _sized_params(sizes), _sized_params(sizes)
    ours = ZeroRedundancyOptimizer(ours_params, torch.optim.Adam,
                                   parameters_as_bucket_view=bucket_view, lr=0.01)
    theirs = TorchZeRO(theirs_params, torch.optim.Adam,
                       parameters_as_bucket_view=bucket_view, lr=0.01)
    # the same partition
    their_indices = [[theirs._param_to_index[p] for p in g["params"]]
                     for g in theirs._partition_parameters()[rank]]
    assert ours.partition.owned(rank) == their_indices
    for step in range(8):
        for params, optimizer in ((ours_params, ours), (theirs_params, theirs)):
            generator = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        for p, q in zip(ours_params, theirs_params):
            assert torch.equal(p, q)
    ours.consolidate_state_dict(to=0)
    theirs.consolidate_state_dict(to=0)
    if rank == 0:
        _assert_same_state_dict(ours.state_dict(), theirs.state_dict())


# -- groups, dtypes, uneven inputs, memory --------------------------------------------------

def test_non_default_group(world):
    rank = world.Get_rank()
    even = world.Split(0 if rank % 2 == 0 else MPI.UNDEFINED, rank)
    if even == MPI.COMM_NULL:
        return
    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=even,
                                   parameters_as_bucket_view=True, lr=0.01)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    assert zero.world_size == (world.Get_size() + 1) // 2
    assert zero.join_process_group is even
    _train([(model, zero), (reference, plain)], 5)
    _assert_same_params(model, reference)
    ours = _consolidated(zero, even)
    _assert_same_state_dict(ours, plain.state_dict())
    del zero
    even.Free()


@pytest.mark.parametrize("piece_bytes", [24, 4096])
def test_without_bucket_view_the_sync_stages_bounded_pieces(setting, piece_bytes):
    """24 bytes: 6 float32 elements a round over all ranks, so parameters are cut across rounds;
    the staging buffer never holds more than a piece, and the parameters keep their storage."""
    setting("TENSORPLAY_HPC_PIECE_BYTES", str(piece_bytes))
    dtypes = (torch.float32, torch.float32, torch.float32)
    model, reference = _model(dtypes), _model(dtypes)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    (staged,) = zero.shard_buffers
    per_rank = max(1, piece_bytes // 4 // zero.world_size)
    assert staged.staging.numel() == min(per_rank * zero.world_size, 40 + 21 + 54)
    largest = max(sum(zero.params_by_index[i].numel() for i in chain(*zero.partition.owned(r)))
                  for r in range(zero.world_size))
    assert len(staged.rounds) == -(-largest // per_rank)
    _train([(model, zero), (reference, plain)], 6)
    _assert_same_params(model, reference)
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages


@pytest.mark.parametrize("bucket_view", [False, True])
def test_mixed_dtypes(bucket_view):
    dtypes = (torch.float32, torch.bfloat16, torch.float32)
    model, reference = _model(dtypes), _model(dtypes)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                   parameters_as_bucket_view=bucket_view, lr=0.01)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    buffers = [b.flat.buffer if bucket_view else b.staging for b in zero.shard_buffers]
    assert [b.dtype for b in buffers] == [torch.float32, torch.bfloat16]
    assert [b.numel() for b in buffers] == [40 + 21, 54]
    if bucket_view:
        for buffer in zero.shard_buffers:
            for param in buffer.params:
                assert param.untyped_storage().data_ptr() == \
                    buffer.flat.buffer.untyped_storage().data_ptr()
    _train([(model, zero), (reference, plain)], 10, freeze_at=5)
    _assert_same_params(model, reference)
    assert model[1].weight.dtype == torch.bfloat16


class GradientAverager(CPUJoinable):
    """A stand-in for data parallelism: averages gradients over the ranks, joinable."""

    def __init__(self, params):
        super().__init__()
        self.params = list(params)

    def average(self):
        Join.notify_join_context(self)
        grads = [p.grad for p in self.params]
        comm.all_reduce_coalesced(grads, self.group.comm)
        torch._foreach_div_(grads, self.group.size)

    def join_hook(self, **kwargs):
        averager = self

        class ZeroGradients(JoinHook):
            def main_hook(self):
                for p in averager.params:
                    p.grad = torch.zeros_like(p)
                averager.average()

        return ZeroGradients()


def _rank_gradient(params, rank, step):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


@pytest.mark.scale
def test_join_with_uneven_inputs(world):
    rank, size = world.Get_rank(), world.Get_size()
    inputs = [3 + r for r in range(size)]
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    averager = GradientAverager(model.parameters())
    with Join([averager, zero]):
        for step in range(inputs[rank]):
            for p, g in zip(model.parameters(), _rank_gradient(model.parameters(), rank, step)):
                p.grad = g
            averager.average()
            zero.step()

    # reference without join: each step averages the gradients of the ranks still training
    reference = _model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(max(inputs)):
        total = [torch.zeros_like(p) for p in reference.parameters()]
        for r in range(size):
            if step < inputs[r]:
                torch._foreach_add_(total, _rank_gradient(reference.parameters(), r, step))
        for p, g in zip(reference.parameters(), total):
            p.grad = g / size
        plain.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_zero_alone_in_join(world):
    rank, size = world.Get_rank(), world.Get_size()
    x = torch.zeros(size * 2, requires_grad=True)
    zero = ZeroRedundancyOptimizer([x], torch.optim.SGD, lr=1.0)
    x.grad = torch.ones_like(x)
    with Join([zero]):
        for _ in range(1 + rank):
            zero.step()
    # the only parameter lives on rank 0, which steps once per iteration of the longest rank
    assert x.tolist() == [-float(size)] * (size * 2)


@pytest.mark.scale
@pytest.mark.parametrize("bucket_view", [False, True])
def test_memory_is_sharded(world, bucket_view):
    from tensorplay_hpc.bench.models import mlp

    size = world.Get_size()
    model = mlp(layers=4, width=64)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                   parameters_as_bucket_view=bucket_view, lr=0.01)
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    _train_mlp_once(model, zero)
    held = sum(p.numel() for p in zero.optim.state)
    assert held <= total / size + largest
    assert sum(world.allgather(held)) == total
    for param, state in zero.optim.state.items():
        assert state["exp_avg"].numel() == state["exp_avg_sq"].numel() == param.numel()


def _train_mlp_once(model, optimizer):
    optimizer.zero_grad()
    data = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    model(data).pow(2).sum().backward()
    optimizer.step()


# -- loading ---------------------------------------------------------------------------------

def test_load_state_dict_leaves_the_callers_dict_alone():
    model, reference = _model(), _model()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    _train([(reference, plain)], 3)
    state_dict = plain.state_dict()
    snapshot = copy.deepcopy(state_dict)
    model.load_state_dict(reference.state_dict())
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.5)
    zero.load_state_dict(state_dict)
    _train([(model, zero)], 3, first_step=3)
    assert state_dict.keys() == snapshot.keys()
    _assert_same_state_dict(state_dict, snapshot)


@pytest.mark.scale
def test_load_state_dict_consolidated_at_another_world_size(world):
    """Consolidated at this size, loaded into optimizers of one rank each (COMM_SELF)."""
    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                   parameters_as_bucket_view=True, lr=0.01)
    _train([(model, zero)], 4)
    state_dict = _consolidated(zero, world)
    reference.load_state_dict(model.state_dict())

    alone = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                    process_group=MPI.COMM_SELF, lr=0.5)
    alone.load_state_dict(state_dict)
    assert alone.world_size == 1
    assert alone.param_groups[0]["lr"] == 0.01
    plain = torch.optim.AdamW(reference.parameters(), lr=0.5)
    plain.load_state_dict(copy.deepcopy(state_dict))
    _train([(model, alone), (reference, plain)], 4, first_step=4)
    _assert_same_params(model, reference)


def test_load_state_dict_checks_the_groups():
    zero = ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="2 parameter groups"):
        zero.load_state_dict({"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]})
    with pytest.raises(ValueError, match="has 1 parameters"):
        zero.load_state_dict({"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]})


# -- overlap with DistributedDataParallel ---------------------------------------------------

def _rank_data(rank, step):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * rank + step))


@pytest.mark.scale
@pytest.mark.parametrize("optimizer_class,kwargs", OPTIMIZERS[:2])
def test_overlap_with_ddp(world, optimizer_class, kwargs):
    from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
        hook_with_zero_step)
    from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from tensorplay_hpc.distributed.parallel import DistributedDataParallel

    rank, size = world.Get_rank(), world.Get_size()
    model, reference = _model(), _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=100 / 2**20)  # 3 buckets of ~100 bytes
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class, overlap_with_ddp=True,
                                   **kwargs)
    with pytest.raises(RuntimeError, match="register_comm_hook"):
        zero.consolidate_state_dict()
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    assert len(ddp.buckets) == 3
    # buckets of 27, 48 and 40 elements, bucket b to rank b % size (PyTorch's assignment)
    expected_owners = {1: [[0], [0], [0]], 2: [[0], [1], [0]], 4: [[0], [1], [2]]}
    if size in expected_owners:
        assert zero.ddp_overlap.owners == expected_owners[size]
    plain = optimizer_class(reference.parameters(), **kwargs)
    for step in range(2):   # PyTorch's warm-up: gradients are averaged, parameters stay
        ddp(_rank_data(rank, step)).sin().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    for step in range(6):
        zero.zero_grad()
        ddp(_rank_data(rank, step)).sin().sum().backward()  # steps: no zero.step()
        plain.zero_grad()
        for r in range(size):
            reference(_rank_data(r, step)).sin().sum().backward()
        for p in reference.parameters():
            p.grad /= size
        plain.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match="does nothing"):
        assert zero.step() is None
    ours = _consolidated(zero, world)
    theirs = plain.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-5, atol=1e-6)


def test_a_shard_loads_from_its_own_entries(world):
    """What a checkpoint reader relies on: only this rank's entries of ``state`` are read."""
    rank = world.Get_rank()
    model, reference = _model(), _model()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    _train([(reference, plain)], 3)
    model.load_state_dict(reference.state_dict())
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.5)
    full = plain.state_dict()
    mine = [i for i, owner in enumerate(zero.partition.rank_of) if owner == rank]
    zero.load_state_dict({"state": {i: full["state"][i] for i in mine},
                          "param_groups": full["param_groups"]})
    assert sorted(zero.local_state_by_index()) == mine
    _train([(model, zero), (reference, plain)], 3, first_step=3)
    _assert_same_params(model, reference)
