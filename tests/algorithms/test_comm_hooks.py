"""Communication hooks with PyTorch's names: 16-bit compression hooks and wrappers, PowerSGD
(per tensor and batched), each against PyTorch's DDP with PyTorch's hook over gloo on the same
ranks; PowerSGD's state through a checkpoint; bad arguments."""
import copy
import os

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_default
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as torch_powerSGD
import torch.nn.functional as F
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from tensorplay_hpc.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from tensorplay_hpc.distributed.parallel import DistributedDataParallel

SMALL_BUCKETS_MB = 0.0005   # about 500 bytes: several buckets
ONE_BUCKET_MB = 25
STEPS = 5
START = 2                   # PowerSGD compresses from the third step on


class _Net(torch.nn.Module):
    """Matrices worth compressing at rank 1 (an 8 x 2 x 3 x 3 convolution kernel seen as
    8 x 18, 16 x 8, 16 x 16 twice, 3 x 16) and vectors. One chain of layers, so that gradients
    arrive in reverse parameter order and PyTorch's DDP, which rebuilds its buckets in arrival
    order after the first iteration, has the same buckets as ours."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(2, 8, 3, bias=False)
        self.inp = torch.nn.Linear(8, 16)
        self.mid1 = torch.nn.Linear(16, 16)
        self.mid2 = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, image):
        h = torch.tanh(self.inp(x + self.conv(image).mean(dim=(2, 3))))
        h = torch.relu(self.mid2(torch.tanh(self.mid1(h))))
        return self.out(h)


def _batch(rank, step, rows=5):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(rows, 8, generator=generator),
            torch.randn(rows, 2, 5, 5, generator=generator),
            torch.randn(rows, 3, generator=generator))


def _step(model, optimizer, rank, step):
    x, image, y = _batch(rank, step)
    optimizer.zero_grad()
    F.mse_loss(model(x, image), y).backward()
    optimizer.step()


def _pair(world, bucket_mb, module=None):
    """Our DDP and PyTorch's of the same module (rank 0's after the broadcast), with SGD."""
    module = module or _Net(seed=world.Get_rank())
    ours = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=bucket_mb)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                       bucket_cap_mb=bucket_mb)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    return (ours, theirs), optimizers


def _recording(hook, seen):
    """PyTorch's ``hook``, noting the gradient shapes of each bucket PyTorch's DDP hands it,
    and completed before the next bucket's starts. PyTorch's PowerSGD hooks start their second
    and third allreduces in future callbacks, which gloo runs on its worker threads in any
    order: with several buckets the ranks' collectives then mismatch or deadlock. Completing
    each bucket in turn changes no arithmetic."""
    def record(state, bucket):
        seen[bucket.index()] = [tuple(g.shape) for g in bucket.gradients()]
        future = hook(state, bucket)
        future.wait()
        return future
    return record


def _assert_equal(a, b, exact, atol, what):
    # Exact at 1 and 2 ranks: the same operations in the same order, and a sum of two numbers
    # does not depend on the order. At 4 ranks MPI and gloo add the four ranks' numbers in
    # different orders, which changes the last bit of sums; ``atol`` bounds what that becomes.
    if exact:
        assert torch.equal(a, b), f"{what}: max difference {(a - b).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=what)


def _run_side_by_side(world, bucket_mb, ours_hook, ours_state, theirs_hook, theirs_state,
                      atol=1e-5):
    models, optimizers = _pair(world, bucket_mb)
    ours, theirs = models
    seen = {}
    ours.register_comm_hook(ours_state, ours_hook)
    theirs.register_comm_hook(theirs_state, _recording(theirs_hook, seen))
    rank, exact = world.Get_rank(), world.Get_size() <= 2
    for step in range(STEPS):
        for model, optimizer in zip(models, optimizers):
            _step(model, optimizer, rank, step)
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            _assert_equal(a.grad, b.grad, exact, atol, f"step {step}, gradient of {name}")
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        _assert_equal(a, b, exact, atol, name)
    # The buckets held the same parameters in both, so both hooks saw the same tensors.
    assert seen == {b.index(): [tuple(p.shape) for p in b.parameters()] for b in ours.buckets}
    return ours, theirs


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compress_hooks_match_torch(world, gloo, name):
    hook = getattr(default_hooks, f"{name}_compress_hook")
    theirs_hook = getattr(torch_default, f"{name}_compress_hook")
    # On four ranks gloo rounds to 16 bits after each addition, in its order, and MPI sums in
    # float32 and rounds once: sums may differ in their last bit (2**-11 relative in float16,
    # 2**-8 in bfloat16); the gradients here are below 1.
    atol = 1e-3 if name == "fp16" else 8e-3
    ours, _ = _run_side_by_side(world, SMALL_BUCKETS_MB, hook, None, theirs_hook, None, atol)
    assert len(ours.buckets) == 4


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compress_wrapper_of_allreduce_is_the_compress_hook(world, gloo, name):
    wrapper = getattr(default_hooks, f"{name}_compress_wrapper")
    theirs_wrapper = getattr(torch_default, f"{name}_compress_wrapper")
    atol = 1e-3 if name == "fp16" else 8e-3
    _run_side_by_side(world, SMALL_BUCKETS_MB, wrapper(default_hooks.allreduce_hook), None,
                      theirs_wrapper(torch_default.allreduce_hook), None, atol)


_POWERSGD_VARIANTS = {
    "defaults": dict(),
    "no_warm_start": dict(warm_start=False),
    # From the second iteration on: PyTorch's DDP has its final buckets only then.
    "cold": dict(use_error_feedback=False, warm_start=False, start_powerSGD_iter=1),
    "rank_2_epsilon_no_error_feedback": dict(matrix_approximation_rank=2, min_compression_rate=1,
                                             orthogonalization_epsilon=1e-8,
                                             use_error_feedback=False),
    "rank_4_qr": dict(matrix_approximation_rank=4, min_compression_rate=1, random_seed=7),
    "batch_same_shape": dict(batch_tensors_with_same_shape=True),
}


def _states(world, variant, **overrides):
    kwargs = dict(matrix_approximation_rank=1, start_powerSGD_iter=START, random_seed=3)
    kwargs.update(_POWERSGD_VARIANTS.get(variant, {}), **overrides)
    return PowerSGDState(world, **kwargs), torch_powerSGD.PowerSGDState(None, **kwargs)


def _assert_states_equal(ours, theirs, exact, atol):
    assert ours.iter == theirs.iter == STEPS
    assert ours.compression_stats() == pytest.approx(theirs.compression_stats())
    assert ours.compression_stats()[0] > 1
    assert sorted(ours.error_dict) == sorted(theirs.error_dict)
    assert sorted(ours.q_memory_dict) == sorted(theirs.q_memory_dict)
    for field in ("error_dict", "q_memory_dict"):
        for index, tensor in getattr(ours, field).items():
            _assert_equal(tensor, getattr(theirs, field)[index], exact, atol, f"{field}[{index}]")


@pytest.mark.parametrize("variant", sorted(_POWERSGD_VARIANTS))
def test_powerSGD_matches_torch(world, gloo, variant):
    ours_state, theirs_state = _states(world, variant)
    # Both 16 x 16 matrices in one bucket to batch them.
    bucket_mb = ONE_BUCKET_MB if variant == "batch_same_shape" else SMALL_BUCKETS_MB
    # Float32 sums of four ranks in another order differ by about 1e-7 relative; the
    # orthogonalization and error feedback carry that along.
    _run_side_by_side(world, bucket_mb, powerSGD_hook.powerSGD_hook, ours_state,
                      torch_powerSGD.powerSGD_hook, theirs_state, atol=1e-5)
    exact = world.Get_size() <= 2
    _assert_states_equal(ours_state, theirs_state, exact, 1e-4)
    if variant == "defaults":   # 832 elements of 5 matrices go as 133, the 51 of the biases as is
        assert ours_state.compression_stats()[1:] == (3 * 883, 3 * 184)


@pytest.fixture
def torch_batched_orthogonalize(monkeypatch):
    """PyTorch 2.13's ``batched_powerSGD_hook`` hands a 2-D ``Q`` to an orthogonalization that
    takes only batches of matrices (it raises ``AssertionError``); give it the 2-D case as a
    batch of one, as our hook computes it."""
    batched = torch_powerSGD._orthogonalize

    def orthogonalize(matrices, epsilon=0):
        batched(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)
    monkeypatch.setattr(torch_powerSGD, "_orthogonalize", orthogonalize)


@pytest.mark.parametrize("variant", ["defaults", "no_warm_start", "one_bucket"])
def test_batched_powerSGD_matches_torch(world, gloo, torch_batched_orthogonalize, variant):
    ours_state, theirs_state = _states(world, "defaults" if variant == "one_bucket" else variant)
    bucket_mb = ONE_BUCKET_MB if variant == "one_bucket" else SMALL_BUCKETS_MB
    _run_side_by_side(world, bucket_mb, powerSGD_hook.batched_powerSGD_hook, ours_state,
                      torch_powerSGD.batched_powerSGD_hook, theirs_state, atol=1e-5)
    _assert_states_equal(ours_state, theirs_state, world.Get_size() <= 2, 1e-4)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compress_wrapper_of_powerSGD_matches_torch(world, gloo, name):
    ours_state, theirs_state = _states(world, "defaults")
    wrapper = getattr(default_hooks, f"{name}_compress_wrapper")
    theirs_wrapper = getattr(torch_default, f"{name}_compress_wrapper")
    # 16-bit sums in another order (4 ranks) differ in the last bit; the low-rank factors
    # carry it on.
    atol = 2e-3 if name == "fp16" else 2e-2
    _run_side_by_side(world, SMALL_BUCKETS_MB, wrapper(powerSGD_hook.powerSGD_hook),
                      ours_state, theirs_wrapper(torch_powerSGD.powerSGD_hook), theirs_state,
                      atol)
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    assert {t.dtype for t in ours_state.error_dict.values()} == {dtype}
    _assert_states_equal(ours_state, theirs_state, world.Get_size() <= 2, 10 * atol)


def test_powerSGD_compresses_only_after_start(world):
    """Plain averaging during the first ``start_powerSGD_iter`` iterations: the same gradients
    as without a hook, and no state yet."""
    state = PowerSGDState(world, start_powerSGD_iter=3)
    with_hook = DistributedDataParallel(_Net(seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    with_hook.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    plain = DistributedDataParallel(_Net(seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    for step in range(3):
        x, image, y = _batch(world.Get_rank(), step)
        for model in (with_hook, plain):
            model.zero_grad()
            F.mse_loss(model(x, image), y).backward()
        for a, b in zip(with_hook.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        assert state.iter == step + 1
        assert state.error_dict == {} and state.q_memory_dict == {}
        assert state.compression_stats() == (0, 0, 0)
    x, image, y = _batch(world.Get_rank(), 3)
    F.mse_loss(with_hook(x, image), y).backward()
    assert state.iter == 4 and sorted(state.q_memory_dict) == [0, 1, 2, 3]
    assert state.compression_stats()[1:] == (883, 184)


def test_bad_arguments_raise():
    # As PyTorch: error feedback and warm start need two iterations of plain averaging.
    for kwargs in (dict(start_powerSGD_iter=1), dict(use_error_feedback=False,
                                                     start_powerSGD_iter=0)):
        with pytest.raises(ValueError, match=r"Expect `start_powerSGD_iter` > 1"):
            PowerSGDState(None, **kwargs)
        with pytest.raises(ValueError, match=r"Expect `start_powerSGD_iter` > 1"):
            torch_powerSGD.PowerSGDState(None, **kwargs)
    # PyTorch accepts rank 0 and then replaces every compressed gradient by zeros.
    for rank in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"matrix_approximation_rank must be an integer of "
                                             rf"at least 1, got {rank}"):
            PowerSGDState(None, matrix_approximation_rank=rank)


def _train(model, optimizer, steps, rank, start=0):
    for step in range(start, start + steps):
        _step(model, optimizer, rank, step)


@pytest.mark.parametrize("hook, warm_start", [("powerSGD_hook", True), ("powerSGD_hook", False),
                                              ("batched_powerSGD_hook", True)])
def test_powerSGD_state_through_checkpoint_resumes_exactly(world, folder, hook, warm_start):
    rank = world.Get_rank()
    hook_fn = getattr(powerSGD_hook, hook)

    def fresh(seed):
        model = DistributedDataParallel(_Net(seed=seed), bucket_cap_mb=SMALL_BUCKETS_MB)
        state = PowerSGDState(world, start_powerSGD_iter=START, warm_start=warm_start,
                              random_seed=11)
        model.register_comm_hook(state, hook_fn)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    uninterrupted, _, optimizer = fresh(0)
    _train(uninterrupted, optimizer, 7, rank)

    first, state, optimizer = fresh(0)
    _train(first, optimizer, 4, rank)
    saved = state.state_dict(prefix="powerSGD.")
    assert saved["powerSGD.iter"] == 4 and "powerSGD.error_dict.2" in saved
    path = checkpoint.save(os.path.join(folder, "powerSGD.h5"), first, optimizer,
                           extra={"step": 4, **saved})

    resumed, state, optimizer = fresh(5)
    extra = checkpoint.load(path, resumed, optimizer)
    state.load_state_dict(extra, prefix="powerSGD.")
    assert extra["step"] == 4 and state.iter == 4
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(extra[key], value), key
    _train(resumed, optimizer, 3, rank, start=4)
    for (name, a), b in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_state_dict_round_trip_continues_the_random_stream(world):
    """Without warm start each step draws new seeds: the generator's position is saved too."""
    state = PowerSGDState(world, use_error_feedback=False, warm_start=False,
                          start_powerSGD_iter=0, random_seed=5)
    state.rng.randint(1000, size=7)
    nested = state.state_dict()
    other = PowerSGDState(world, use_error_feedback=False, warm_start=False,
                          start_powerSGD_iter=0, random_seed=99)
    other.load_state_dict(nested)
    assert other.rng.randint(1_000_000_000, size=3).tolist() == \
        state.rng.randint(1_000_000_000, size=3).tolist()


def test_state_of_another_layout_raises(world):
    """A loaded state whose buckets do not fit the model's raises before any collective of
    the bucket, on every rank alike."""
    state = PowerSGDState(world, start_powerSGD_iter=START)
    nested = state.state_dict()
    nested.update(iter=START, error_dict={0: torch.zeros(5)}, q_memory_dict={0: torch.ones(4)})
    state.load_state_dict(nested)
    model = DistributedDataParallel(_Net(seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    x, image, y = _batch(world.Get_rank(), 0)
    with pytest.raises(ValueError, match=r"the error feedback of bucket 0 has 5 elements, the "
                                         r"bucket 323: was the state loaded from another model"):
        F.mse_loss(model(x, image), y).backward()
    del nested["error_dict"][0]
    state.load_state_dict(nested)
    model = DistributedDataParallel(_Net(seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    with pytest.raises(ValueError, match=r"the Q of bucket 0 has 4 elements, this bucket needs "
                                         r"32: was the state loaded from another model"):
        F.mse_loss(model(x, image), y).backward()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("hook", ["powerSGD_hook", "batched_powerSGD_hook"])
def test_powerSGD_gives_every_rank_the_same_gradients(world, hook):
    """Different data on each rank, one compressed gradient on all: the replicas stay equal,
    while each rank's error feedback is its own."""
    state = PowerSGDState(world, start_powerSGD_iter=START)
    model = DistributedDataParallel(_Net(seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    model.register_comm_hook(state, getattr(powerSGD_hook, hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, START + 2, world.Get_rank())
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    errors = torch.cat([state.error_dict[b] for b in sorted(state.error_dict)])
    everyone = world.allgather((grads, errors))
    for other_grads, other_errors in everyone[1:]:
        assert torch.equal(other_grads, everyone[0][0])
        assert not torch.equal(other_errors, everyone[0][1])


@pytest.mark.mpi(min_size=2)
def test_powerSGD_on_a_subgroup(world, gloo):
    """A sub-communicator: the even ranks compress among themselves, matching PyTorch's hook on
    a gloo group of the same ranks; the odd ranks are not members."""
    rank = world.Get_rank()
    evens = world.Split(0 if rank % 2 == 0 else MPI.UNDEFINED, rank)
    theirs_group = gloo.new_group(list(range(0, world.Get_size(), 2)))
    if rank % 2:
        with pytest.raises(ValueError, match=r"is not a member of process_group"):
            PowerSGDState(evens)
        return
    ours_state = PowerSGDState(evens, start_powerSGD_iter=START, random_seed=3)
    theirs_state = torch_powerSGD.PowerSGDState(theirs_group, start_powerSGD_iter=START,
                                                random_seed=3)
    module = _Net(seed=0)
    ours = DistributedDataParallel(copy.deepcopy(module), process_group=evens,
                                   bucket_cap_mb=SMALL_BUCKETS_MB)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module),
                                                       process_group=theirs_group,
                                                       bucket_cap_mb=SMALL_BUCKETS_MB)
    ours.register_comm_hook(ours_state, powerSGD_hook.powerSGD_hook)
    theirs.register_comm_hook(theirs_state, _recording(torch_powerSGD.powerSGD_hook, {}))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(START + 2):
        for model, optimizer in zip((ours, theirs), optimizers):
            _step(model, optimizer, rank, step)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)   # at most 2 even ranks below 5 ranks: sums of two
    evens.Free()
