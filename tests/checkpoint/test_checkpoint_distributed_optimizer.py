"""Checkpoints of a DistributedOptimizer: each owner saves and restores the values and state of
the parameters in its window memory; continuing after a load equals an uninterrupted run; loading
into other parameters is an error on every rank."""
import os

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.comm import capabilities
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer

WORLD = MPI.COMM_WORLD
ADAM = dict(lr=0.01, amsgrad=True)
SAVED_AT, STEPS = 3, 6


@pytest.fixture(params=["auto", "mpi", "served"])
def windows(request, monkeypatch):
    """Windows of the transport the ranks' capabilities give (shared memory on one node), from
    ``Win.Allocate`` (where MPI supports it between the ranks), and served windows."""
    if request.param == "mpi" and not capabilities.one_sided_works(WORLD):
        pytest.skip("MPI has no one-sided windows between these ranks")
    if request.param != "auto":
        monkeypatch.setenv(capabilities.TRANSPORT_ENV, request.param)
    return request.param


def owned(rank, seed=100):
    """What ``rank`` owns: two trained tensors and one that never gets a gradient."""
    generator = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(5, generator=generator).requires_grad_(),
            torch.randn(3, 4, generator=generator).requires_grad_(),
            torch.randn(2, generator=generator).requires_grad_()]


def train(refs, optimizer, steps):
    """Steps ``steps`` on ``refs`` (the third gets no gradient); each rank trains the next
    rank's parameters, so every parameter has one trainer and the result is deterministic."""
    for step in steps:
        with autograd.context() as context_id:
            first, second, _ = [ref.to_here() for ref in refs]
            loss = ((first.sin() * (step + 1)).sum() + (second ** 2 * (step + 2)).sum())
            autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    WORLD.Barrier()  # every trainer is done before anyone saves, reads or frees


def outcome(shared, optimizer):
    """Every parameter's value and state, seen from this rank."""
    return [(ref.to_here(), optimizer.state_of(ref)) for ref in shared.refs]


def assert_same(found, expected):
    for (value, state), (expected_value, expected_state) in zip(found, expected, strict=True):
        assert torch.equal(value, expected_value)
        assert state.keys() == expected_state.keys()
        for key, entry in expected_state.items():
            assert torch.equal(state[key], entry)


def uninterrupted():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    with rma.share(owned(rank)) as shared:
        refs = shared.refs_of((rank + 1) % size)
        with DistributedOptimizer(torch.optim.Adam, refs, **ADAM) as optimizer:
            train(refs, optimizer, range(STEPS))
            found = outcome(shared, optimizer)
            WORLD.Barrier()
    return found


def test_continue_after_load_equals_uninterrupted_run(folder, windows):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    target = (rank + 1) % size
    expected = uninterrupted()
    path = os.path.join(folder, "distributed.h5")
    with rma.share(owned(rank)) as shared:
        refs = shared.refs_of(target)
        with DistributedOptimizer(torch.optim.Adam, refs, **ADAM) as optimizer:
            train(refs, optimizer, range(SAVED_AT))
            at_save = outcome(shared, optimizer)
            checkpoint.save(path, optimizer=optimizer, extra={"step": SAVED_AT})
            WORLD.Barrier()

    with checkpoint.Reader(path) as reader:
        assert reader.attribute("optimizer", "kind") == "distributed"
        assert reader.attribute("optimizer", "class") == "torch.optim.adam.Adam"
        assert sorted(reader.names("optimizer/parameters"), key=int) == [
            str(i) for i in range(3 * size)]
        assert sorted(reader.names("optimizer/state"), key=int) == [
            str(i) for i in range(3 * size) if i % 3 != 2]  # never stepped: none
        assert torch.equal(reader.tensor("optimizer/parameters/1"), at_save[1][0])
        assert torch.equal(reader.tensor("optimizer/state/1/exp_avg"), at_save[1][1]["exp_avg"])
        [group] = reader.decoded("optimizer", "param_groups")
        assert group["params"] == list(range(3 * size))
        assert (group["lr"], group["amsgrad"], group["betas"]) == (0.01, True, (0.9, 0.999))
        assert reader.decoded("optimizer", "attributes")["parameters"][:2] == [
            [0, 0, [5], "float32"], [0, 1, [3, 4], "float32"]]

    with rma.share(owned(rank, seed=7)) as shared:  # other values, and state that must go
        refs = shared.refs_of(target)
        with DistributedOptimizer(torch.optim.Adam, refs, **ADAM) as optimizer:
            with autograd.context() as context_id:
                autograd.backward(context_id, [sum(ref.to_here().sum() for ref in refs)])
                optimizer.step(context_id)
            WORLD.Barrier()
            assert checkpoint.load(path, optimizer=optimizer)["step"] == SAVED_AT
            assert_same(outcome(shared, optimizer), at_save)
            assert torch.equal(shared.refs_of(rank)[0].local_value(), at_save[3 * rank][0])
            WORLD.Barrier()
            train(refs, optimizer, range(SAVED_AT, STEPS))
            assert_same(outcome(shared, optimizer), expected)
            WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
def test_state_is_read_by_its_owner_only(folder):
    """Rank 0 owns nothing; rank 1 owns everything and trains nothing."""
    rank = WORLD.Get_rank()
    path = os.path.join(folder, "one-owner.h5")
    mine = [torch.arange(4.0, requires_grad=True)] if rank == 1 else []
    with rma.share(mine) as shared:
        [ref] = shared.refs
        with DistributedOptimizer(torch.optim.SGD, [ref], lr=0.5, momentum=0.5) as optimizer:
            if rank == 0:
                train_once(ref, optimizer)
            WORLD.Barrier()
            assert optimizer.owned_indices() == ([0] if rank == 1 else [])
            checkpoint.save(path, optimizer=optimizer)
            WORLD.Barrier()
    with rma.share([torch.zeros(4, requires_grad=True)] if rank == 1 else []) as shared:
        [ref] = shared.refs
        with DistributedOptimizer(torch.optim.SGD, [ref], lr=0.5, momentum=0.5) as optimizer:
            checkpoint.load(path, optimizer=optimizer)
            assert torch.equal(ref.to_here(), torch.arange(4.0) - 1.0)
            assert torch.equal(optimizer.state_of(ref)["momentum_buffer"], torch.full((4,), 2.0))
            WORLD.Barrier()
            if rank == 0:
                train_once(ref, optimizer)  # momentum continues: 0.5 * 2 + 2
            WORLD.Barrier()
            assert torch.equal(ref.to_here(), torch.arange(4.0) - 2.5)
            WORLD.Barrier()


def train_once(ref, optimizer):
    with autograd.context() as context_id:
        autograd.backward(context_id, [ref.to_here().sum() * 2])
        optimizer.step(context_id)


@pytest.mark.parametrize("change", ["shape", "count"])
def test_loading_into_other_parameters_is_an_error(folder, change):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    path = os.path.join(folder, "structure.h5")
    with rma.share([torch.ones(5), torch.ones(3, 4)]) as shared:
        with DistributedOptimizer(torch.optim.Adam, shared.refs_of(rank), lr=0.1) as optimizer:
            checkpoint.save(path, optimizer=optimizer)
    if change == "shape":
        other = [torch.ones(5), torch.ones(4, 3)]
        first = ("parameter 1 is tensor 1 of rank 0 (float32, shape (3, 4)) in the file, "
                 "tensor 1 of rank 0 (float32, shape (4, 3)) here")
    else:
        other = [torch.ones(5), torch.ones(3, 4), torch.ones(1)]
        in_file = "tensor 0 of rank 1 (float32, shape (5,))" if size > 1 else "absent"
        first = (f"parameter 2 is {in_file} in the file, tensor 2 of rank 0 (float32, shape "
                 "(1,)) here")
    with rma.share(other) as shared:
        with DistributedOptimizer(torch.optim.Adam, shared.refs_of(rank), lr=0.1) as optimizer:
            with pytest.raises(checkpoint.CheckpointError,
                               match=f"failed on {size} of {size} ranks") as info:
                checkpoint.load(path, optimizer=optimizer)
            message = str(info.value)
            assert (f"rank {rank}: CheckpointError: the DistributedOptimizer's parameters do "
                    f"not match the checkpoint's ({2 * size} in the file, {len(other) * size} "
                    f"here): {first}") in message
            assert torch.equal(shared.refs_of(rank)[0].local_value(), torch.ones(5))


def test_a_plain_optimizer_checkpoint_is_refused(folder):
    path = os.path.join(folder, "plain.h5")
    weight = torch.nn.Parameter(torch.ones(3))
    checkpoint.save(path, optimizer=torch.optim.Adam([weight], lr=0.1))
    with rma.share([torch.ones(3)]) as shared:
        with DistributedOptimizer(torch.optim.Adam, shared.refs, lr=0.1) as optimizer:
            with pytest.raises(checkpoint.CheckpointError,
                               match="holds no DistributedOptimizer parameters"):
                checkpoint.load(path, optimizer=optimizer)
            WORLD.Barrier()
