"""DistributedOptimizer over MPI windows: parity with the same torch.optim optimizer applied
locally, concurrent trainers against an owner that does not call MPI, errors."""
import time

import pytest
import torch

from mpi4py import MPI

from tensorplay_hpc.comm import capabilities
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer
from tensorplay_hpc.distributed.optim.distributed_optimizer import DIRECT_ENV

CONFIGS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
]
STEPS = 4


@pytest.fixture(params=["direct", "fetch", "mpi", "served"])
def step_path(request, monkeypatch):
    """Run stepping on the transport the ranks' capabilities give, in place where it is shared
    memory (one node; across nodes it is served windows here); on the same transport with Get
    and Put; on MPI windows from ``Win.Allocate`` (where MPI supports them between the ranks);
    and on served windows. Across nodes, cases that would repeat ``fetch`` are skipped."""
    monkeypatch.setenv(DIRECT_ENV, "1" if request.param == "direct" else "0")
    if request.param == "direct" and not capabilities.within_one_node(MPI.COMM_WORLD):
        pytest.skip("across nodes no window is in shared memory: the same steps as [fetch]")
    if request.param in ("mpi", "served") and not capabilities.one_sided_works(MPI.COMM_WORLD):
        if request.param == "mpi":
            pytest.skip("MPI has no one-sided windows between these ranks")
        if not capabilities.within_one_node(MPI.COMM_WORLD):
            pytest.skip("without one-sided MPI between nodes, [fetch] runs on served windows")
    if request.param in ("mpi", "served"):
        monkeypatch.setenv(capabilities.TRANSPORT_ENV, request.param)
    return request.param


def stepped_in_place(shared, step_path):
    """Whether a DistributedOptimizer's steps run on the owner's memory itself."""
    return step_path == "direct" and shared.transport == "shared"


def initial_parameters(owner):
    """What rank ``owner`` owns, trainable: the same values wherever they are made."""
    generator = torch.Generator().manual_seed(100 + owner)
    return [torch.randn(5, generator=generator).requires_grad_(),
            torch.randn(3, 4, generator=generator).requires_grad_()]


def loss_of(params, step):
    """A loss whose gradient depends on the parameters and the step."""
    return sum(((p.sin() + 0.1 * p ** 2) * (step + 1 + i)).sum() for i, p in enumerate(params))


def step_side_by_side(optimizer, refs, local_optimizer, local):
    """STEPS steps of ``optimizer`` on the remote ``refs`` and of ``local_optimizer`` on their
    local copies ``local``, with the same losses."""
    for step in range(STEPS):
        with autograd.context() as context_id:
            autograd.backward(context_id, [loss_of([r.to_here() for r in refs], step)])
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        loss_of(local, step).backward()
        local_optimizer.step()


@pytest.mark.parametrize("optimizer_class,kwargs", CONFIGS,
                         ids=[f"{c.__name__}-{'-'.join(k)}" for c, k in CONFIGS])
def test_matches_the_same_optimizer_applied_locally(world, step_path, optimizer_class, kwargs):
    rank, size = world.Get_rank(), world.Get_size()
    target = (rank + 1) % size  # every rank trains the next rank's parameters, all at once
    with rma.share(initial_parameters(rank)) as shared:
        refs = shared.refs_of(target)
        local = [p.requires_grad_() for p in initial_parameters(target)]
        local_optimizer = optimizer_class(local, **kwargs)
        with DistributedOptimizer(optimizer_class, refs, **kwargs) as optimizer:
            assert optimizer.in_place == stepped_in_place(shared, step_path)
            step_side_by_side(optimizer, refs, local_optimizer, local)
            for ref, expected in zip(refs, local):
                assert torch.equal(ref.to_here(), expected.detach())
                remote_state = optimizer.state_of(ref)
                local_state = local_optimizer.state[expected]
                assert remote_state.keys() == local_state.keys()
                for key, value in local_state.items():
                    assert torch.equal(torch.as_tensor(remote_state[key]), torch.as_tensor(value))
            world.Barrier()  # nobody frees the windows while another rank still steps


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_match_the_local_optimizer(world, step_path, dtype):
    rank, size = world.Get_rank(), world.Get_size()
    target = (rank + 1) % size
    kwargs = dict(lr=0.125, momentum=0.5)
    with rma.share([p.detach().to(dtype).requires_grad_()
                    for p in initial_parameters(rank)]) as shared:
        refs = shared.refs_of(target)
        local = [p.detach().to(dtype).requires_grad_() for p in initial_parameters(target)]
        local_optimizer = torch.optim.SGD(local, **kwargs)
        with DistributedOptimizer(torch.optim.SGD, refs, **kwargs) as optimizer:
            step_side_by_side(optimizer, refs, local_optimizer, local)
            for ref, expected in zip(refs, local):
                assert ref.to_here().dtype == dtype
                assert torch.equal(ref.to_here(), expected.detach())
            world.Barrier()


def test_parameter_without_gradient_stays_unchanged(world, step_path):
    rank, size = world.Get_rank(), world.Get_size()
    with rma.share(initial_parameters(rank)) as shared:
        used, unused = shared.refs_of((rank + 1) % size)
        with DistributedOptimizer(torch.optim.Adam, [used, unused], lr=0.1) as optimizer:
            before = unused.to_here()
            with autograd.context() as context_id:
                autograd.backward(context_id, [used.to_here().sum()])
                unused.to_here()  # fetched in the context, but no gradient reaches it
                optimizer.step(context_id)
            assert torch.equal(unused.to_here(), before)
            assert optimizer.state_of(unused) == {}
            assert optimizer.state_of(used)["step"].item() == 1.0
            world.Barrier()


class RejectsLargeGradients(torch.optim.SGD):
    """SGD that refuses gradients above 1000."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.abs().max() > 1000:
                    raise ValueError("gradient above 1000")
        return super().step(closure)


def test_error_inside_a_step_reaches_the_caller(world, step_path):
    rank, size = world.Get_rank(), world.Get_size()
    owner = (rank + 1) % size
    with rma.share([torch.ones(3, requires_grad=True)]) as shared:
        [ref] = shared.refs_of(owner)
        with DistributedOptimizer(RejectsLargeGradients, [ref], lr=1.0) as optimizer:
            with autograd.context() as context_id:
                autograd.backward(context_id, [ref.to_here().sum() * 1e6])
                with pytest.raises(RuntimeError, match=(
                        rf"rank {rank}: RejectsLargeGradients failed on parameters \[0\] of rank "
                        rf"{owner} \(.*\): gradient above 1000")) as info:
                    optimizer.step(context_id)
                assert isinstance(info.value.__cause__, ValueError)
            assert torch.equal(ref.to_here(), torch.ones(3))
            with autograd.context() as context_id:  # the locks were released: steps go on
                autograd.backward(context_id, [ref.to_here().sum() * 2])
                optimizer.step(context_id)
            assert torch.equal(ref.to_here(), torch.full((3,), -1.0))
            world.Barrier()


def test_unknown_context_is_an_error(world):
    with rma.share([torch.zeros(2)]) as shared:
        with DistributedOptimizer(torch.optim.SGD, shared.refs, lr=0.1) as optimizer:
            with pytest.raises(ValueError, match="unknown distributed autograd context id 4242"):
                optimizer.step(4242)


def test_bad_construction_is_reported(world):
    with pytest.raises(ValueError, match="at least one remote reference"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    with rma.share([torch.zeros(2)]) as shared:
        with pytest.raises(RuntimeError, match=r"constructing DistributedOptimizer\(SGD\) failed "
                           r"on \d+ of \d+ ranks: rank 0: ValueError: Invalid learning rate: -1.0"):
            DistributedOptimizer(torch.optim.SGD, shared.refs, lr=-1.0)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_all_raise(world):
    rank = world.Get_rank()
    with rma.share([torch.zeros(2)]) as shared:
        with pytest.raises(ValueError,
                           match=r"the state SGD keeps .*: ranks \[1\] differ from rank 0"):
            DistributedOptimizer(torch.optim.SGD, shared.refs, lr=0.1,
                                 momentum=0.9 if rank == 1 else 0.0)
        with pytest.raises(RuntimeError, match=r"constructing DistributedOptimizer\(SGD\) failed "
                           r"on 1 of \d+ ranks: rank 1: ValueError: Invalid learning rate: -1.0$"):
            DistributedOptimizer(torch.optim.SGD, shared.refs, lr=-1.0 if rank == 1 else 0.1)


def owner_computes_without_mpi(param, expected, seconds=60.0):
    """The owner's loop: reads its parameter locally, never calls MPI, until it holds
    ``expected`` or time runs out. Returns the distinct values it saw."""
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = param.sum().item() / param.numel()
        seen.add(value)
        if torch.equal(param, expected):
            break
        time.sleep(1e-4)
    return seen


@pytest.mark.mpi(min_size=2)
@pytest.mark.scale   # every other rank asks one owner at once
def test_concurrent_trainers_never_lose_an_update(world, step_path):
    """Every other rank makes 50 SGD steps (lr 1, gradient 1) on a parameter of rank 0, which
    computes without calling MPI until it sees all of them. At 4 ranks over two nodes (ranks 0
    and 1 on the first), trainers 2 and 3 step across nodes through served windows."""
    rank, size = world.Get_rank(), world.Get_size()
    steps, trainers = 50, size - 1
    param = torch.full((1000,), 1000.0, requires_grad=True)
    with rma.share([param] if rank == 0 else []) as shared:
        if step_path in ("mpi", "served"):
            assert shared.transport == step_path
        elif not capabilities.within_one_node(world):
            assert shared.transport in ("mpi", "served")
        [ref] = shared.refs
        with DistributedOptimizer(torch.optim.SGD, [ref], lr=1.0) as optimizer:
            world.Barrier()
            if rank == 0:
                expected = torch.full((1000,), 1000.0 - steps * trainers)
                seen = owner_computes_without_mpi(param, expected)
                assert torch.equal(param, expected), f"the owner saw {sorted(seen)}"
            else:
                for _ in range(steps):
                    with autograd.context() as context_id:
                        value = ref.to_here()
                        # a reader never sees half an update: all elements agree
                        assert torch.equal(value, value[0].expand_as(value))
                        autograd.backward(context_id, [value.sum()])
                        optimizer.step(context_id)
            world.Barrier()
            assert torch.equal(ref.to_here(), torch.full((1000,), 1000.0 - steps * trainers))
            world.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.scale
def test_concurrent_adam_steps_continue_one_state(world, step_path):
    rank, size = world.Get_rank(), world.Get_size()
    steps, trainers = 30, size - 1
    param = torch.full((64,), 2.0, requires_grad=True)
    local = torch.full((64,), 2.0, requires_grad=True)
    local_adam = torch.optim.Adam([local], lr=0.01)
    for _ in range(steps * trainers):  # gradient 1 every time: the order of trainers is moot
        local.grad = torch.ones(64)
        local_adam.step()
    with rma.share([param] if rank == 0 else []) as shared:
        [ref] = shared.refs
        with DistributedOptimizer(torch.optim.Adam, [ref], lr=0.01) as optimizer:
            world.Barrier()
            if rank == 0:
                owner_computes_without_mpi(param, local.detach())
            else:
                for _ in range(steps):
                    with autograd.context() as context_id:
                        autograd.backward(context_id, [ref.to_here().sum()])
                        optimizer.step(context_id)
            world.Barrier()
            if rank == 0:
                state = optimizer.state_of(ref)
                assert state["step"].item() == steps * trainers
                assert torch.equal(state["exp_avg"], local_adam.state[local]["exp_avg"])
                assert torch.equal(param, local.detach())
            world.Barrier()


@pytest.mark.mpi(min_size=2)
def test_owner_reads_its_parameters_between_remote_updates(world):
    rank = world.Get_rank()
    weight = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    with rma.share([weight] if rank == 0 else []) as shared:
        [ref] = shared.refs
        with DistributedOptimizer(torch.optim.SGD, [ref], lr=0.5) as optimizer:
            for step in range(3):
                if rank == 1:
                    with autograd.context() as context_id:
                        autograd.backward(context_id, [ref.to_here().sum() * 2])
                        optimizer.step(context_id)
                world.Barrier()
                if rank == 0:  # the owner's own model computes with the updated weight
                    expected = torch.arange(4, dtype=torch.float32) - (step + 1)
                    assert torch.equal(weight.detach(), expected)
                    assert torch.equal(torch.nn.functional.linear(torch.ones(1, 4), weight[None]),
                                       expected.sum().reshape(1, 1))
                world.Barrier()


FROZEN_MIX = [((5,), True), ((3, 4), False), ((4,), True), ((2,), False)]  # (shape, trained)
PYTORCH_CONFIGS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (torch.optim.RMSprop, dict(lr=0.01)),
    (torch.optim.Rprop, dict(lr=0.01)),
    (torch.optim.Adadelta, dict(lr=1.0)),
]


def frozen_mix(owner, index=None):
    """What rank ``owner`` owns: trainable tensors and frozen ones (``requires_grad=False``);
    tensor ``index`` alone if given (made on the owner by PyTorch's RPC)."""
    generator = torch.Generator().manual_seed(200 + owner)
    made = [torch.randn(shape, generator=generator).requires_grad_(trained)
            for shape, trained in FROZEN_MIX]
    return made if index is None else made[index]


def train_on_refs(optimizer, fetch, context, backward):
    """STEPS steps through one API (ours or PyTorch's): fetch the values, backward, step."""
    for step in range(STEPS):
        with context() as context_id:
            backward(context_id, [loss_of(fetch(), step)])
            optimizer.step(context_id)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script inside PyTorch
def test_frozen_parameters_stay_frozen_as_with_pytorch_over_rpc(world):
    """Every rank trains the next rank's mix of trainable and frozen tensors with ours and with
    PyTorch's DistributedOptimizer over torch.distributed.rpc: the same values, and the frozen
    ones exactly as they were."""
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    from tensorplay_hpc.bench.gloo import set_rendezvous

    rank, size = world.Get_rank(), world.Get_size()
    target = (rank + 1) % size
    ours = {}
    for optimizer_class, kwargs in PYTORCH_CONFIGS:
        with rma.share(frozen_mix(rank)) as shared:
            refs = shared.refs_of(target)
            assert [ref.requires_grad for ref in refs] == [t for _, t in FROZEN_MIX]
            with DistributedOptimizer(optimizer_class, refs, **kwargs) as optimizer:
                train_on_refs(optimizer, lambda: [r.to_here() for r in refs], autograd.context,
                              autograd.backward)
                ours[optimizer_class] = [ref.to_here() for ref in refs]
                world.Barrier()
    set_rendezvous(world)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=size,
                 backend=rpc.BackendType.TENSORPIPE,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions())
    try:
        for optimizer_class, kwargs in PYTORCH_CONFIGS:
            rrefs = [rpc.remote(f"worker{target}", frozen_mix, args=(target, i))
                     for i in range(len(FROZEN_MIX))]
            theirs = TorchDistributedOptimizer(optimizer_class, rrefs, **kwargs)
            train_on_refs(theirs, lambda: [r.to_here() for r in rrefs], dist_autograd.context,
                          dist_autograd.backward)
            initial = frozen_mix(target)
            for i, ((_, trained), rref) in enumerate(zip(FROZEN_MIX, rrefs)):
                mine = ours[optimizer_class][i]
                assert torch.equal(mine, rref.to_here().detach()), (optimizer_class, i)
                assert torch.equal(mine, initial[i].detach()) != trained, (optimizer_class, i)
            world.Barrier()
    finally:
        rpc.shutdown()
