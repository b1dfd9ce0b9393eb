"""Checkpoint calls whose arguments must agree across ranks: a save or a load naming another
file on some ranks, a call made on some ranks only, replicas that differ saved as one, an extra
key a load could not read. Each is an error on every rank naming the ranks, and nothing is
written (the previous checkpoint stays) or loaded."""
import os

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.checkpoint import CheckpointError
from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
from tensorplay_hpc.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.mpi(min_size=2)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def train_step(model, optimizer, seed):
    torch.manual_seed(seed)
    optimizer.zero_grad()
    model(torch.randn(8, 6)).square().sum().backward()
    optimizer.step()


def files(folder):
    """Every file of ``folder`` with its bytes, once every rank has finished with it."""
    WORLD.Barrier()
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in sorted(os.listdir(folder))}


def tensors(model, optimizer):
    state = optimizer.state_dict()["state"] if optimizer is not None else {}
    return ([t.clone() for t in model.state_dict().values()]
            + [v.clone() for entry in state.values() for v in entry.values()
               if isinstance(v, torch.Tensor)])


def others():
    """The ranks other than 0, as the messages list them."""
    rest = list(range(1, WORLD.Get_size()))
    return "rank 1" if rest == [1] else f"ranks {rest}"


def test_save_with_a_different_path_on_some_ranks_writes_nothing(folder):
    model, rank = make_model(), WORLD.Get_rank()
    path = os.path.join(folder, "step-1.h5")
    checkpoint.save(path, model, extra={"step": 1})
    before = files(folder)
    mine = path if rank == 0 else os.path.join(folder, f"rank{rank}.h5")
    with pytest.raises(CheckpointError) as raised:
        checkpoint.save(mine, model, extra={"step": 2})
    message = str(raised.value)
    assert message.startswith(f"checkpoint.save({mine!r}) on rank {rank}: the ranks name "
                              f"different files (rank 0: {path!r}; rank 1: "
                              f"{os.path.join(folder, 'rank1.h5')!r}")
    assert message.endswith("every rank must pass the same path. Nothing was written.")
    assert files(folder) == before


def test_load_of_different_files_on_some_ranks_loads_nothing(folder):
    model = make_model()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    paths = []
    for step in (1, 2):
        train_step(model, optimizer, step)
        paths.append(checkpoint.save(os.path.join(folder, f"step-{step}.h5"), model, optimizer,
                                     extra={"step": step}))
    fresh = make_model()
    fresh_optimizer = ZeroRedundancyOptimizer(fresh.parameters(), torch.optim.Adam, lr=0.1)
    train_step(fresh, fresh_optimizer, 7)
    before = tensors(fresh, fresh_optimizer.optim)
    mine = paths[0] if WORLD.Get_rank() == 0 else paths[1]
    with pytest.raises(CheckpointError) as raised:
        checkpoint.load(mine, fresh, fresh_optimizer)
    message = str(raised.value)
    assert (f"the ranks name different files (rank 0: {paths[0]!r}; {others()}: {paths[1]!r})"
            in message)
    assert message.endswith("Nothing was loaded.")
    after = tensors(fresh, fresh_optimizer.optim)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert checkpoint.load(paths[1], fresh, fresh_optimizer)["step"] == 2   # agreed: loads


def test_save_on_rank_0_only_then_a_load_names_the_call_each_rank_is_in(folder):
    """PyTorch's ``if rank == 0: torch.save(...)`` followed by a load on every rank: the save's
    collectives would be matched with the load's, and the load's "no such checkpoint file"
    would come back to rank 0 as the save's failure."""
    model, rank = make_model(), WORLD.Get_rank()
    path = os.path.join(folder, "model.h5")
    with pytest.raises(CheckpointError) as raised:
        if rank == 0:
            checkpoint.save(path, model)
        else:
            checkpoint.load(path, model)
    message = str(raised.value)
    if rank == 0:
        verb = "is" if WORLD.Get_size() == 2 else "are"
        assert message.startswith(
            f"checkpoint.save({path!r}) on rank 0: {others()} of {WORLD.Get_size()} {verb} "
            f"not in checkpoint.save but in another call (rank 1 in checkpoint.load({path!r})")
        assert message.endswith("must call it (not only rank 0, as with torch.save). "
                                "Nothing was written.")
    else:
        assert message.startswith(
            f"checkpoint.load({path!r}) on rank {rank}: rank 0 of {WORLD.Get_size()} is not in "
            f"checkpoint.load but in another call (rank 0 in checkpoint.save({path!r}))")
    assert "no such checkpoint file" not in message
    assert files(folder) == {}


def test_diverged_replicas_saved_as_one_write_nothing(folder):
    """Post-local SGD between averagings: each rank's replica has its own values. Without
    ``replica_group`` a save would write a mix of them; with it, each copy is saved."""
    rank = WORLD.Get_rank()
    model = make_model()
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      averagers.PeriodicModelAverager(period=100, warmup_steps=0))
    path = checkpoint.save(os.path.join(folder, "replicas.h5"), model, optimizer)
    before = files(folder)
    for step in range(2):                   # averaged at the first step, not at the second
        train_step(model, optimizer, seed=10 * step + rank)     # different data on each rank
    with pytest.raises(CheckpointError) as raised:
        checkpoint.save(path, model, optimizer)
    assert str(raised.value) == (
        f"checkpoint.save({path!r}): the replicated state differs between the ranks: "
        f"{others()} of {WORLD.Get_size()} {'holds' if WORLD.Get_size() == 2 else 'hold'} "
        "another copy than rank 0 (first difference: "
        "model entry '0.weight'), and a save without replica_group writes one copy for all. "
        "Pass replica_group (the ranks holding each copy, such as post-local SGD's subgroup) "
        "to save every copy, or average the replicas first. Nothing was written.")
    assert files(folder) == before
    own = WORLD.Split(rank, 0)
    checkpoint.save(path, model, optimizer, replica_group=own)
    with checkpoint.Reader(path) as reader:
        assert reader.has(f"replica{WORLD.Get_size() - 1}/model/0.weight")
    own.Free()


def test_extra_key_with_a_slash_writes_nothing(folder):
    model, last = make_model(), WORLD.Get_size() - 1
    path = checkpoint.save(os.path.join(folder, "step-1.h5"), model, extra={"step": 1})
    before = files(folder)
    extra = {"step": 2, "rng/cpu": torch.ones(2)} if WORLD.Get_rank() == last else {"step": 2}
    with pytest.raises(CheckpointError) as raised:
        checkpoint.save(os.path.join(folder, "step-2.h5"), model, extra=extra)
    assert str(raised.value) == (
        f"saving checkpoint {os.path.join(folder, 'step-2.h5')} failed on 1 of "
        f"{WORLD.Get_size()} ranks: rank {last}: ValueError: extra key 'rng/cpu': keys must be "
        "non-empty strings without '/'")
    assert files(folder) == before
    assert checkpoint.latest(folder) == path
