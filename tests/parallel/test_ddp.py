"""DistributedDataParallel: parity with PyTorch's DDP over gloo, gradient accumulation, unused
parameters, static graphs, zero-element parameters, model checks, misuse across ranks, and
communication hooks (plain averaging and post-local SGD)."""
import copy
import time

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState, post_localSGD_hook)
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

SMALL_BUCKETS_MB = 0.0005   # about 500 bytes: several buckets for the models below


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _batch(rank, step, rows=6):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)


def _assert_grads_equal(ours, theirs):
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        if b.grad is None:
            assert a.grad is None, name
        else:
            torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.scale   # buckets against ranks
@pytest.mark.parametrize("variant", ["default", "bucket_view", "allreduce_hook", "big_bucket"])
def test_matches_torch_ddp(world, gloo, variant):
    rank = world.Get_rank()
    module = _mlp(seed=rank)   # different on every rank: both DDPs broadcast rank 0's
    ours = DistributedDataParallel(
        copy.deepcopy(module), bucket_cap_mb=25 if variant == "big_bucket" else SMALL_BUCKETS_MB,
        gradient_as_bucket_view=variant == "bucket_view")
    if variant == "allreduce_hook":
        ours.register_comm_hook(None, allreduce_hook)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                       bucket_cap_mb=SMALL_BUCKETS_MB)
    assert len(ours.buckets) == (1 if variant == "big_bucket" else 3)
    rank0 = _mlp(seed=0)
    for a, b, c in zip(ours.parameters(), theirs.parameters(), rank0.parameters()):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for step in range(6):
        x, y = _batch(rank, step)
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(x), y).backward()
        _assert_grads_equal(ours, theirs)
        for optimizer in optimizers:
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)
    if variant in ("default", "big_bucket"):   # averaged where they are: no bucket buffers
        assert all(bucket._flat is None for bucket in ours.buckets)
    if variant == "bucket_view":   # every gradient lives inside a bucket buffer
        ranges = [(b.buffer().data_ptr(), b.buffer().data_ptr() + 4 * b.buffer().numel())
                  for b in ours.buckets]
        assert all(any(start <= p.grad.data_ptr() < end for start, end in ranges)
                   for p in ours.parameters())


@pytest.mark.parametrize("bucket_view", [False, True])
def test_no_sync_accumulation_equals_larger_batch(world, bucket_view):
    rank, size = world.Get_rank(), world.Get_size()
    ddp = DistributedDataParallel(_mlp(seed=3), bucket_cap_mb=SMALL_BUCKETS_MB,
                                  gradient_as_bucket_view=bucket_view)
    micro_batches = 3
    for step in range(micro_batches):
        x, y = _batch(rank, step)
        if step < micro_batches - 1:
            with ddp.no_sync():
                F.mse_loss(ddp(x), y, reduction="sum").backward()
            local = [p.grad.clone() for p in ddp.parameters()]
        else:
            F.mse_loss(ddp(x), y, reduction="sum").backward()
    # The same model on every rank's whole data at once: the mean over ranks of the sums.
    reference = _mlp(seed=3)
    inputs = [_batch(r, s) for r in range(size) for s in range(micro_batches)]
    x = torch.cat([b[0] for b in inputs])
    y = torch.cat([b[1] for b in inputs])
    (F.mse_loss(reference(x), y, reduction="sum") / size).backward()
    for a, b in zip(ddp.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    # Inside no_sync the gradients stayed local: this rank's first two micro-batches only.
    local_reference = _mlp(seed=3)
    for s in range(micro_batches - 1):
        F.mse_loss(local_reference(_batch(rank, s)[0]), _batch(rank, s)[1],
                   reduction="sum").backward()
    for a, b in zip(local, local_reference.parameters()):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-5)


class _TwoHeads(torch.nn.Module):
    """A trunk and two heads; head ``b`` is used only when asked, ``never`` is never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.trunk = torch.nn.Linear(8, 16)
        self.a = torch.nn.Linear(16, 4)
        self.b = torch.nn.Linear(16, 4)
        self.never = torch.nn.Linear(16, 4)

    def forward(self, x, use_b):
        h = torch.relu(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


def test_unused_parameters_match_torch_ddp(world, gloo):
    rank = world.Get_rank()
    ours = DistributedDataParallel(_TwoHeads(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                   find_unused_parameters=True)
    theirs = torch.nn.parallel.DistributedDataParallel(_TwoHeads(), bucket_cap_mb=SMALL_BUCKETS_MB,
                                                       find_unused_parameters=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
                  for m in (ours, theirs)]
    for step in range(5):
        use_b = (rank + step) % 3 == 0   # head b: used on some ranks, some steps
        x, y = _batch(rank, step)
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            F.mse_loss(model(x, use_b), y).backward()
        _assert_grads_equal(ours, theirs)
        assert ours.module.never.weight.grad is None
        for optimizer in optimizers:
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)


def test_unused_parameter_without_flag_is_an_error(world):
    size = world.Get_size()
    ddp = DistributedDataParallel(_TwoHeads(), bucket_cap_mb=SMALL_BUCKETS_MB)
    reference = _TwoHeads()
    for step in range(2):   # the collectives were completed, so each iteration ends the same
        ddp.zero_grad()
        reference.zero_grad()
        x, y = _batch(world.Get_rank(), step)
        with pytest.raises(RuntimeError, match=rf"backward pass failed on {size} of {size} ranks: "
                                               r"rank 0: RuntimeError: parameters received no "
                                               r"gradient.*'never.weight'.*find_unused_parameters"):
            F.mse_loss(ddp(x, True), y).backward()
        for r in range(size):
            xr, yr = _batch(r, step)
            (F.mse_loss(reference(xr, True), yr) / size).backward()
        torch.testing.assert_close(ddp.module.trunk.weight.grad, reference.trunk.weight.grad)
        torch.testing.assert_close(ddp.module.never.weight.grad, torch.zeros(4, 16))


@pytest.mark.mpi(min_size=2)
def test_mismatched_models_raise_on_every_rank(world):
    rank = world.Get_rank()
    module = torch.nn.Sequential(torch.nn.Linear(8, 5 if rank == 1 else 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"the model: ranks \[1\] differ from rank 0.*position 0: "
                                         r"rank 0 has \('0.weight', \(\(4, 8\).*rank 1 has "
                                         r"\('0.weight', \(\(5, 8\)"):
        DistributedDataParallel(module)
    extra = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3 if rank == 1 else 2)])
    with pytest.raises(ValueError, match=r"rank 1 has 6 entries against rank 0's 4.*position 4: "
                                         r"rank 0 has nothing, rank 1 has \('2.weight'"):
        DistributedDataParallel(extra)


@pytest.mark.mpi(min_size=2)
def test_requires_grad_or_arguments_differing_raise_on_every_rank(world):
    rank = world.Get_rank()
    module = _mlp(seed=0)
    module[2].bias.requires_grad_(rank != 1)
    with pytest.raises(ValueError, match=r"the model: ranks \[1\] differ from rank 0.*position 3: "
                                         r"rank 0 has \('2.bias', \(\(16,\), 'float32', 'cpu'\), "
                                         r"'requires_grad=True'\), rank 1 has \('2.bias', "
                                         r"\(\(16,\), 'float32', 'cpu'\), 'requires_grad=False'\)"):
        DistributedDataParallel(module)
    with pytest.raises(ValueError, match=r"the arguments: ranks \[1\] differ from rank 0.*rank 0 "
                                         r"has \('bucket_cap_mb', 25.0\), rank 1 has "
                                         r"\('bucket_cap_mb', 1.0\)"):
        DistributedDataParallel(_mlp(seed=0), bucket_cap_mb=1 if rank == 1 else 25)


class _OptionalHead(torch.nn.Module):
    """A trunk, a head, and an ``extra`` head used only when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.trunk = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra):
        h = torch.tanh(self.trunk(x))
        return self.head(h) + (self.extra(h) if use_extra else 0)


def _mean_optional_head_grads(size, step, uses):
    reference = _OptionalHead()
    for r in range(size):
        x, y = _batch(r, step)
        (F.mse_loss(reference(x, uses(r)), y) / size).backward()
    return [p.grad for p in reference.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("hook", [False, True])
def test_parameter_unused_on_one_rank_is_the_same_error_on_every_rank(world, hook):
    rank, size = world.Get_rank(), world.Get_size()
    ddp = DistributedDataParallel(_OptionalHead(), bucket_cap_mb=SMALL_BUCKETS_MB)
    if hook:
        ddp.register_comm_hook(None, allreduce_hook)
    x, y = _batch(rank, 0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"DistributedDataParallel's backward pass failed on 1 "
                                           rf"of {size} ranks: rank 1: RuntimeError: parameters "
                                           r"received no gradient in the backward pass: "
                                           r"\['extra.weight', 'extra.bias'\].*"
                                           r"find_unused_parameters=True"):
        F.mse_loss(ddp(x, rank != 1), y).backward()
    assert time.monotonic() - start < 30
    # Every bucket was reduced (rank 1 gave zeros for ``extra``), so the ranks are still in step.
    expected = _mean_optional_head_grads(size, 0, lambda r: r != 1)
    for p, e in zip(ddp.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    ddp.zero_grad()
    x, y = _batch(rank, 1)
    F.mse_loss(ddp(x, True), y).backward()
    for p, e in zip(ddp.parameters(), _mean_optional_head_grads(size, 1, lambda r: True)):
        torch.testing.assert_close(p.grad, e)


def test_static_graph_matches_torch_ddp(world, gloo):
    rank = world.Get_rank()
    ours = DistributedDataParallel(_TwoHeads(), bucket_cap_mb=SMALL_BUCKETS_MB, static_graph=True)
    theirs = torch.nn.parallel.DistributedDataParallel(
        _TwoHeads(), bucket_cap_mb=SMALL_BUCKETS_MB, static_graph=True)
    assert ours.static_graph and theirs.static_graph
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    use_b = rank % 2 == 0   # the same in every iteration; ``never`` is never used
    for step in range(4):
        x, y = _batch(rank, step)
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            F.mse_loss(model(x, use_b), y).backward()
        _assert_grads_equal(ours, theirs)
        assert ours.module.never.weight.grad is None
        for optimizer in optimizers:
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)
    with pytest.warns(UserWarning, match="no need to set it again"):
        ours._set_static_graph()
    late = DistributedDataParallel(_mlp(seed=1), find_unused_parameters=True)
    with pytest.warns(UserWarning, match="`_set_static_graph` will detect unused parameters"):
        late._set_static_graph()
    assert late.static_graph


def test_static_graph_parameter_used_later_is_an_error_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    ddp = DistributedDataParallel(_OptionalHead(), bucket_cap_mb=SMALL_BUCKETS_MB)
    ddp._set_static_graph()
    x, y = _batch(rank, 0)
    F.mse_loss(ddp(x, False), y).backward()   # learns: ``extra`` is unused
    assert ddp.module.extra.weight.grad is None
    with pytest.raises(RuntimeError, match=rf"failed on 1 of {size} ranks: rank 0: RuntimeError: "
                                           r"parameters received a gradient but had none in the "
                                           r"first iteration \(static_graph=True needs the same "
                                           r"parameters used in every iteration\): "
                                           r"\['extra.bias', 'extra.weight'\]"):
        F.mse_loss(ddp(x, rank == 0), y).backward()


class _WithEmpty(torch.nn.Module):
    """Zero-element parameters first, between others and last in bucket order, a zero-element
    buffer, and (``unused``) a zero-element parameter that the loss does not use."""

    def __init__(self, seed, unused):
        super().__init__()
        torch.manual_seed(seed)
        self.empty_first = torch.nn.Parameter(torch.zeros(0, 8))
        self.a = torch.nn.Linear(8, 16)
        self.empty_middle = torch.nn.Parameter(torch.zeros(0))
        self.b = torch.nn.Linear(16, 4)
        self.empty_last = torch.nn.Parameter(torch.zeros(4, 0))
        if unused:
            self.empty_unused = torch.nn.Parameter(torch.zeros(0, 2))
        self.register_buffer("empty_buffer", torch.zeros(0))

    def forward(self, x):
        h = torch.relu(self.a(x)) + (x @ self.empty_first.t()).sum()
        return self.b(h + self.empty_middle.sum()) + (self.empty_last @ x[:, :0].t()).sum()


@pytest.mark.parametrize("variant", ["default", "bucket_view", "tiny_buckets", "find_unused",
                                     "allreduce_hook"])
def test_zero_element_parameters_match_torch_ddp(world, gloo, variant):
    rank = world.Get_rank()
    module = _WithEmpty(seed=rank, unused=variant == "find_unused")
    arguments = dict(bucket_cap_mb=1e-6 if variant == "tiny_buckets" else SMALL_BUCKETS_MB,
                     gradient_as_bucket_view=variant == "bucket_view",
                     find_unused_parameters=variant == "find_unused")
    ours = DistributedDataParallel(copy.deepcopy(module), **arguments)
    if variant == "allreduce_hook":
        ours.register_comm_hook(None, allreduce_hook)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module), **arguments)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for step in range(3):
        x, y = _batch(rank, step)
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
        _assert_grads_equal(ours, theirs)
        for optimizer in optimizers:
            optimizer.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    assert ours.module.empty_first.grad.shape == (0, 8)
    assert ours.module.empty_last.grad.shape == (4, 0)
    if variant == "find_unused":
        assert ours.module.empty_unused.grad is None


def test_comm_hook_sees_buckets_and_may_return_a_future(world):
    rank, size = world.Get_rank(), world.Get_size()
    seen = []
    private = comm.ProcessGroup()

    def hook(state, bucket):
        seen.append((bucket.index(), bucket.is_last(),
                     [tuple(p.shape) for p in bucket.parameters()],
                     [tuple(g.shape) for g in bucket.gradients()]))
        result = bucket.buffer().clone()
        comm.all_reduce(result, private.comm, comm.ReduceOp.AVG)
        future = torch.futures.Future()
        future.set_result([result])   # like PyTorch's work futures: a one-element list
        return future

    ddp = DistributedDataParallel(_mlp(seed=1), bucket_cap_mb=SMALL_BUCKETS_MB)
    ddp.register_comm_hook("state", hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, hook)
    x, y = _batch(rank, 0)
    F.mse_loss(ddp(x), y).backward()
    shapes = [(4,), (4, 16), (16,), (16, 16), (16,), (16, 16), (16,), (16, 8)]
    assert [s[0] for s in seen] == [0, 1, 2] and [s[1] for s in seen] == [False, False, True]
    assert [shape for s in seen for shape in s[2]] == shapes
    assert [shape for s in seen for shape in s[3]] == shapes
    reference = _mlp(seed=1)
    for r in range(size):
        x, y = _batch(r, 0)
        (F.mse_loss(reference(x), y) / size).backward()
    for a, b in zip(ddp.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    private.close()


def _local_grads(rank, step):
    """The gradient of rank ``rank``'s loss at ``step``, for the fixed model of the hook test."""
    model = _mlp(seed=5)
    x, y = _batch(rank, step)
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def _mean_grads(ranks, step):
    grads = [_local_grads(r, step) for r in ranks]
    return [sum(g[i] for g in grads) / len(ranks) for i in range(len(grads[0]))]


def _world_ranks(communicator):
    return list(communicator.Get_group().Translate_ranks(
        list(range(communicator.Get_size())), MPI.COMM_WORLD.Get_group()))


@pytest.mark.parametrize("subgroup", ["pairs", "node", "none"])
def test_post_local_sgd_hook_phases(world, subgroup):
    rank, size = world.Get_rank(), world.Get_size()
    pairs = world.Split(rank // 2, rank)
    if subgroup == "pairs":
        state = PostLocalSGDState(None, pairs, start_localSGD_iter=2)
        local_ranks = _world_ranks(pairs)
    elif subgroup == "node":
        state = PostLocalSGDState(None, None, start_localSGD_iter=2)
        # The ranks on this rank's host, consecutive or not (``--map-by node``).
        hosts = world.allgather(MPI.Get_processor_name())
        local_ranks = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        assert _world_ranks(state.subgroup) == local_ranks
    else:
        state = PostLocalSGDState(None, None, start_localSGD_iter=2,
                                  post_local_gradient_allreduce=False)
        local_ranks = [rank]
    ddp = DistributedDataParallel(_mlp(seed=5), bucket_cap_mb=SMALL_BUCKETS_MB)
    ddp.register_comm_hook(state, post_localSGD_hook)
    for step in range(4):
        ddp.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
        expected = _mean_grads(range(size) if step < 2 else local_ranks, step)
        for p, e in zip(ddp.parameters(), expected):
            torch.testing.assert_close(p.grad, e)
        assert state.iter == min(step + 1, 2)
    pairs.Free()
