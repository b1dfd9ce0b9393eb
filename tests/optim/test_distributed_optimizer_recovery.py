"""Surviving a lost owner of DistributedOptimizer parameters: an owner's window memory read back
on every rank (every lane), the transport recovery takes, and jobs under Open MPI 5 with ULFM in
which one rank, or a whole simulated node, dies at a commit or in the middle of a step."""
import random
import re
import time

import pytest
import torch

from mpi4py import MPI

import ulfm_lane
from launch import SUPPORT, only_in_single_rank_run
from tensorplay_hpc.comm import capabilities, fault_tolerance
from tensorplay_hpc.comm.small_collectives import all_gather_object
from tensorplay_hpc.distributed import autograd, rma
from tensorplay_hpc.distributed.optim import DistributedOptimizer
from tensorplay_hpc.distributed.optim.distributed_optimizer_copies import (
    DistributedOptimizerCopies)


def owned(rank):
    """Rank ``rank``'s tensors: every third rank none, frozen ones among them."""
    if rank % 3 == 2:
        return []
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 4, generator=generator).requires_grad_(),
            torch.randn(2, generator=generator, dtype=torch.float64),
            torch.randn(5, generator=generator).requires_grad_()]


def test_every_rank_reads_an_owners_window_memory_back():
    """``owned_bytes`` of each owner, read on every rank, gives its values and Adam state (after
    two steps by every trainer), as the owner's own ``owned_parameters`` and ``owned_state``;
    the parameter a trainer never stepped has no state; a short buffer is refused."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    with rma.share(owned(rank)) as shared:
        stepped = [ref for ref in shared.refs if ref.requires_grad and ref.index == 0]
        with DistributedOptimizer(torch.optim.Adam, shared.refs, lr=0.1) as optimizer:
            for step in range(2):
                with autograd.context() as context_id:
                    loss = sum((ref.to_here() * (step + 1)).square().sum() for ref in stepped)
                    autograd.backward(context_id, [loss])
                    optimizer.step(context_id)
                world.Barrier()
            indices = {(ref.owner(), ref.index): i
                       for i, ref in enumerate(optimizer.parameter_refs)}
            mine = (optimizer.owned_bytes(), optimizer.owned_parameters(), optimizer.owned_state())
            for owner, (payload, values, states) in enumerate(all_gather_object(mine, world)):
                held = optimizer.read_owned_bytes(owner, payload)
                assert len(held) == len(owned(owner))
                for index, ((value, state), tensor) in enumerate(zip(held, owned(owner))):
                    i = indices[(owner, index)]
                    assert torch.equal(value, values[i]) and value.dtype == tensor.dtype
                    assert value.requires_grad == tensor.requires_grad
                    assert set(state) == ({"step", "exp_avg", "exp_avg_sq"} if index == 0
                                          else set())
                    for key, entry in state.items():
                        assert torch.equal(entry, states[i][key])
                    if index == 0:
                        assert state["step"].item() == 2 * world.Get_size()
                if owned(owner):
                    with pytest.raises(ValueError, match=f"are not rank {owner}'s window memory"):
                        optimizer.read_owned_bytes(owner, payload[:20])
            world.Barrier()


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="copies need a partner rank")
def test_copies_order_the_parameters_by_origin_and_keep_them_after_a_commit():
    """``refs`` lists every shared tensor by origin ``(world rank, index)``, whichever rank
    shares it; origins given to a share that lists them out of order keep their own order."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    tensors = [torch.full((2,), float(10 * rank + i)).requires_grad_() for i in range(2)]
    with rma.share(tensors[::-1]) as shared, \
            DistributedOptimizer(torch.optim.SGD, shared.refs, lr=0.1) as optimizer:
        copies = DistributedOptimizerCopies(optimizer, origins=[(rank, 1), (rank, 0)])
        try:
            assert [copies.origins[ref] for ref in copies.refs] == [
                (r, i) for r in range(size) for i in range(2)]
            assert [ref.to_here()[0].item() for ref in copies.refs] == [
                float(10 * r + i) for r in range(size) for i in range(2)]
            copies.commit(1)
        finally:
            copies.close()
        with pytest.raises(ValueError, match="1 origins for the 2 tensors"):
            DistributedOptimizerCopies(optimizer, origins=[(rank, 0)])


@pytest.mark.skipif(MPI.Query_thread() < MPI.THREAD_MULTIPLE,
                    reason="served windows need MPI_THREAD_MULTIPLE")
def test_recovery_takes_served_windows(monkeypatch):
    """MPI's windows do not survive a lost rank (a lock the lost rank held is never released),
    served ones do: with recovery on, ``auto`` takes ``served`` on one node and across nodes,
    and without it the first transport that works."""
    monkeypatch.delenv(capabilities.TRANSPORT_ENV, raising=False)
    fault_tolerance.enable()
    try:
        with rma.share([torch.zeros(2)]) as shared:
            assert shared.transport == "served"
        monkeypatch.setenv(capabilities.TRANSPORT_ENV, "served")
        with rma.share([torch.zeros(2)]) as shared:
            assert shared.transport == "served"
    finally:
        fault_tolerance.disable()
    monkeypatch.delenv(capabilities.TRANSPORT_ENV)
    with rma.share([torch.zeros(2)]) as shared:
        assert shared.transport == ("shared" if capabilities.within_one_node(MPI.COMM_WORLD)
                                    else "mpi" if capabilities.one_sided_works(MPI.COMM_WORLD)
                                    else "served")


def run_job(tmp_path, victims, kill_after, steps, delay=0.0, nodes=None):
    """Run ``distopt_recovery_job.py`` on 4 ranks; its output, and the seconds from the first
    victim's death to the survivors' first step after recovery."""
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        job = ulfm_lane.start(4, [str(SUPPORT / "distopt_recovery_job.py"),
                                  ",".join(map(str, victims)), str(kill_after), str(steps),
                                  str(delay)], out, err, nodes=nodes)
        code = ulfm_lane.wait(job, 150)
    output = (tmp_path / "out").read_text()
    report = output + (tmp_path / "err").read_text()
    assert code != ulfm_lane.STILL_RUNNING, report
    assert output.count("transport served") == 4, report
    left = min(float(t) for t in re.findall(r"^\[\d\] leaving at (\S+)", output, re.M))
    recovered = re.findall(r"^\[(\d)\] recovered step (\d+) of \d+, lost (\[.*?\]), owning (\d+) "
                           r"tensors, state (\w+), at (\S+)", output, re.M)
    survivors = sorted(set(range(4)) - set(victims))
    assert sorted(int(r[0]) for r in recovered) == survivors, report
    assert {r[2] for r in recovered} == {str(sorted(victims))}, report
    assert {r[4] for r in recovered} == {"same"}, report   # bit for bit the committed state
    steps_back = {int(r[1]) for r in recovered}
    assert len(steps_back) == 1, report
    finished = re.findall(rf"^\[(\d)\] finished {steps} loss \S+ digest (\w+)", output, re.M)
    assert sorted(int(f[0]) for f in finished) == survivors, report
    assert len({f[1] for f in finished}) == 1, report
    return output, {int(r[0]): int(r[3]) for r in recovered}, steps_back.pop(), \
        max(float(r[5]) for r in recovered) - left


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(180)
def test_survivors_take_over_a_lost_owners_parameters(tmp_path):
    """World rank 2 of 4 dies right after committing step 4: its partner (rank 3, the next on
    one node) takes over its weight and bias, and every survivor goes on from the newest step
    all hold (4, or 3 while the copies of 4 were still travelling) with the parameters and
    Adam's state bit for bit those of that step, and finishes."""
    _, owning, step, seconds = run_job(tmp_path, [2], 4, 8)
    assert owning == {0: 2, 1: 2, 3: 4}
    assert step in (3, 4)
    assert seconds < 10


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(180)
def test_an_owner_lost_in_the_middle_of_a_step_is_survived(tmp_path):
    """World rank 1 dies at a random moment after committing step 3, as likely as not while it
    holds a lock on some owner's windows: the survivors are not left waiting for it."""
    _, owning, step, seconds = run_job(tmp_path, [1], 3, 12, delay=random.uniform(0.05, 0.4))
    assert owning == {0: 2, 2: 4, 3: 2}
    assert step >= 2
    assert seconds < 10


@only_in_single_rank_run
@pytest.mark.skipif(ulfm_lane.missing() is not None, reason=str(ulfm_lane.missing()))
@pytest.mark.timeout(240)
def test_a_whole_lost_node_is_survived(simulated_nodes, tmp_path):
    """Both ranks of the second of 2 simulated nodes die together in a step: their parameters
    come back from the copies on the first node (ranks 2 and 3 back up on ranks 0 and 1)."""
    start = time.time()
    _, owning, step, seconds = run_job(tmp_path, [2, 3], 4, 12, delay=random.uniform(0.05, 0.4),
                                       nodes=simulated_nodes)
    assert owning == {0: 4, 1: 4}
    assert step >= 3
    assert seconds < 10 and time.time() - start < 120
