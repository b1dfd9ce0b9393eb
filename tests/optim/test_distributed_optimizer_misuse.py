"""DistributedOptimizer misused: an optimizer that cannot step fails in step() (not in the
constructor), a wrong optimizer_class is a TypeError naming it, and use after close() is a
clear RuntimeError, on every rank."""
import pytest
import torch

from tensorplay_hpc.comm.watchdog import TIMEOUT_ENV
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer
from tensorplay_hpc.distributed.optim.distributed_optimizer import DIRECT_ENV

from optimizer_classes import NOT_OPTIMIZER_CLASSES, not_an_optimizer_class


class CannotStep(torch.optim.SGD):
    """SGD whose step always fails."""

    def step(self, closure=None):
        raise RuntimeError("this optimizer cannot step")


class RejectsZeroGradients(torch.optim.SGD):
    """SGD with momentum that refuses a gradient of zeros (as a zero dummy has)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not p.grad.any():
                    raise ValueError("all-zero gradient")
        return super().step(closure)


def _train_next_rank(world, optimizer_class, **kwargs):
    """Construct ``optimizer_class`` over the next rank's tensor and step it once with gradient
    2; return the error of the step on this rank, the value afterwards and the context id."""
    rank, size = world.Get_rank(), world.Get_size()
    with rma.share([torch.ones(3, requires_grad=True)]) as shared:
        [ref] = shared.refs_of((rank + 1) % size)
        with DistributedOptimizer(optimizer_class, [ref], **kwargs) as optimizer:
            with autograd.context() as context_id:
                autograd.backward(context_id, [ref.to_here().sum() * 2])
                with pytest.raises(RuntimeError) as caught:
                    optimizer.step(context_id)
            after = ref.to_here()
            assert optimizer.state_of(ref) == {}
            world.Barrier()
    return caught.value, after, context_id


@pytest.mark.parametrize("direct", ["1", "0"])
def test_an_optimizer_that_cannot_step_fails_in_step_on_every_rank(world, monkeypatch, direct):
    monkeypatch.setenv(DIRECT_ENV, direct)
    rank, size = world.Get_rank(), world.Get_size()
    error, after, context_id = _train_next_rank(world, CannotStep, lr=0.5)
    assert str(error) == (f"DistributedOptimizer.step(context {context_id}) on rank {rank}: "
                          f"CannotStep failed on parameters [0] of rank {(rank + 1) % size} (they "
                          "were left unchanged): this optimizer cannot step")
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__) == "this optimizer cannot step"
    assert torch.equal(after, torch.ones(3))
    assert world.allgather(True) == [True] * size  # every rank got here, with its error


def test_an_optimizer_that_fails_only_on_a_zero_dummy_changes_nothing(world):
    rank, size = world.Get_rank(), world.Get_size()
    error, after, context_id = _train_next_rank(world, RejectsZeroGradients, lr=0.5,
                                                momentum=0.9)
    assert str(error) == (
        f"DistributedOptimizer.step(context {context_id}) on rank {rank}: parameters [0] of rank {(rank + 1) % size} were left unchanged: their "
        "state layout is unknown, since RejectsZeroGradients's step on a zero dummy parameter "
        "failed at construction (ValueError: all-zero gradient)")
    assert torch.equal(after, torch.ones(3))


@pytest.mark.parametrize("kind, match", NOT_OPTIMIZER_CLASSES)
def test_optimizer_class_must_be_an_optimizer_subclass(world, kind, match):
    optimizer_class = not_an_optimizer_class(kind)
    with rma.share([torch.ones(2, requires_grad=True)]) as shared:
        with pytest.raises(TypeError, match=rf"^DistributedOptimizer: optimizer_class must be a "
                                            rf"torch.optim.Optimizer subclass, {match}"):
            DistributedOptimizer(optimizer_class, shared.refs, lr=0.1)
        # checked before any collective: a rank alone gets the error too
        if world.Get_rank() == 0:
            with pytest.raises(TypeError, match="optimizer_class"):
                DistributedOptimizer(optimizer_class, shared.refs, lr=0.1)


def test_use_after_close_is_an_error(world):
    rank = world.Get_rank()
    closed = f"DistributedOptimizer is closed \\(rank {rank}\\): "
    with rma.share([torch.ones(2, requires_grad=True)]) as shared:
        [ref] = shared.refs_of(rank)
        optimizer = DistributedOptimizer(torch.optim.SGD, [ref], lr=0.5, momentum=0.5)
        optimizer.close()
        optimizer.close()  # closing again does nothing
        with autograd.context() as context_id:
            autograd.backward(context_id, [ref.to_here().sum()])
            with pytest.raises(RuntimeError, match=closed + r"step\(\) cannot be used after "
                                                   r"close\(\), which freed its state"):
                optimizer.step(context_id)
        for call, name in [(lambda: optimizer.state_of(ref), "state_of()"),
                           (optimizer.owned_state, "owned_state()"),
                           (optimizer.owned_parameters, "owned_parameters()"),
                           (lambda: optimizer.load_owned({}, {}), "load_owned()")]:
            with pytest.raises(RuntimeError, match=closed + name.replace("(", r"\(")
                               .replace(")", r"\)")):
                call()
        assert torch.equal(ref.to_here(), torch.ones(2))  # the references still work
        world.Barrier()


@pytest.mark.parametrize("watched", [False, True])
def test_an_open_optimizer_over_closed_shared_tensors_is_an_error(world, setting, watched):
    """Its close() then frees its window after the communicator it was made over (the
    watchdog, when on, cannot count that free, but still watches it)."""
    if watched:
        setting(TIMEOUT_ENV, "60")
    rank = world.Get_rank()
    shared = rma.share([torch.ones(2, requires_grad=True)])
    [ref] = shared.refs_of(rank)
    with DistributedOptimizer(torch.optim.SGD, [ref], lr=0.5) as optimizer:
        with autograd.context() as context_id:
            autograd.backward(context_id, [ref.to_here().sum()])
            world.Barrier()
            shared.close()
            with pytest.raises(RuntimeError, match=rf"^SharedTensors is closed \(rank {rank}\)"):
                optimizer.step(context_id)
        with pytest.raises(RuntimeError, match="SharedTensors is closed"):
            optimizer.state_of(ref)
    with pytest.raises(RuntimeError, match=rf"^SharedTensors is closed \(rank {rank}\)"):
        DistributedOptimizer(torch.optim.SGD, [ref], lr=0.5)
