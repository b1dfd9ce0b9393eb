"""A ZeRO checkpoint loaded at another number of ranks within one job: saved on every rank,
continued on all but one, saved there and continued on every rank again, each step equal to
one plain Adam's. (The nested jobs of ``test_checkpoint_jobs.py`` reshard between 1 and 3 ranks
as separate runs; these go as far as the pass's ranks.)"""
import os

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc import checkpoint
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer

WORLD = MPI.COMM_WORLD
SIZES = [7, 1, 300, 2, 40]
"""Five parameters: at 8 ranks some ranks own none."""


def _parameters(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in SIZES]


def _step(params, optimizer, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()


def _zero(params, group):
    return ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.05, process_group=group)


@pytest.mark.scale
@pytest.mark.mpi(min_size=2)
def test_zero_continues_on_one_rank_fewer_and_back_like_one_adam(folder):
    fewer = WORLD.size - 1
    reference = _parameters(0)
    adam = torch.optim.Adam(reference, lr=0.05)
    params = _parameters(0)
    zero = _zero(params, WORLD)
    for step in range(2):
        _step(params, zero, step)
        _step(reference, adam, step)
    saved = checkpoint.save(os.path.join(folder, "all.h5"), torch.nn.ParameterList(params), zero)
    zero.close()

    _step(reference, adam, 2)
    subgroup = WORLD.Split(0 if WORLD.rank < fewer else MPI.UNDEFINED, WORLD.rank)
    if subgroup != MPI.COMM_NULL:
        params = _parameters(1)
        zero = _zero(params, subgroup)
        checkpoint.load(saved, torch.nn.ParameterList(params), zero, process_group=subgroup)
        _step(params, zero, 2)
        assert all(torch.equal(p, q) for p, q in zip(params, reference))
        checkpoint.save(os.path.join(folder, "fewer.h5"), torch.nn.ParameterList(params), zero,
                        process_group=subgroup)
        zero.close()
        subgroup.Free()
    WORLD.Barrier()

    _step(reference, adam, 3)
    params = _parameters(2)
    zero = _zero(params, WORLD)
    checkpoint.load(os.path.join(folder, "fewer.h5"), torch.nn.ParameterList(params), zero)
    _step(params, zero, 3)
    assert all(torch.equal(p, q) for p, q in zip(params, reference))
    zero.close()
